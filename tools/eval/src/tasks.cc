#include "kvr/eval_endpoint/tasks.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvr/common/status.h"

namespace kvr::eval_endpoint {
namespace {

// Common English nouns: the keys of the magic-number tasks, the words of common_words and the
// names in the licence fact. Lower case, one token or two for most tokenizers.
constexpr std::string_view kWords[] = {
    "apple",   "river",   "candle",   "garden",  "window",  "pencil",  "forest",  "bridge",
    "castle",  "dragon",  "engine",   "falcon",  "guitar",  "harbor",  "island",  "jacket",
    "kettle",  "ladder",  "magnet",   "needle",  "orange",  "parrot",  "quartz",  "rabbit",
    "saddle",  "tunnel",  "umbrella", "valley",  "wallet",  "yogurt",  "zebra",   "anchor",
    "basket",  "cactus",  "dolphin",  "feather", "glacier", "hammer",  "iceberg", "jungle",
    "lantern", "meadow",  "nutmeg",   "oyster",  "pepper",  "riddle",  "saffron", "teapot",
    "velvet",  "walnut",  "blanket",  "cricket", "desert",  "emerald", "fossil",  "goblet",
    "helmet",  "ivory",   "jasmine",  "kitten",  "lemon",   "marble",  "noodle",  "orchid",
    "pillow",  "rocket",  "silver",   "tomato",  "violin",  "whistle", "button",  "carpet",
    "donkey",  "elbow",   "fiddle",   "ginger",  "hollow",  "insect",  "kernel",  "lizard",
    "mirror",  "napkin",  "oxygen",   "pebble",  "rhythm",  "sponge",  "thunder", "vessel",
    "wizard",  "badger",  "cobalt",   "denim",   "ember",   "flannel", "granite", "hazel",
    "lobster", "mustard", "nickel",   "olive",   "pickle",  "radish",  "salmon",  "timber",
    "turnip",  "waffle",  "beacon",   "copper",  "dagger",  "fabric",  "gravel",  "honey",
    "juniper", "kayak",   "lentil",   "mango",   "nectar",  "otter",   "puzzle",  "quiver",
};
constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);

// The repetitive haystack of the needle tasks (the passkey task's, Mohtashami & Jaggi 2023),
// one sentence per unit so that the length can be fitted finely.
constexpr std::string_view kNoise[] = {"The grass is green.", "The sky is blue.",
                                       "The sun is yellow.", "Here we go.",
                                       "There and back again."};
// Depths of niah_single's key and qa_licenses' fact, in turn by sample index.
constexpr double kDepths[] = {0.5, 0.1, 0.9, 0.3, 0.7};

uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A sample's own seed: independent streams per (seed, task, length, index).
uint64_t SampleSeed(const SampleSpec& spec) {
  return SplitMix(SplitMix(SplitMix(spec.seed ^ Fnv1a(spec.task)) ^ spec.target_tokens) ^
                  spec.index);
}

std::string Number(std::mt19937_64& rng, uint64_t lo, uint64_t hi) {
  return absl::StrCat(std::uniform_int_distribution<uint64_t>(lo, hi)(rng));
}

// `n` distinct words of kWords, in random order.
std::vector<std::string> DistinctWords(std::mt19937_64& rng, size_t n) {
  std::vector<std::string> all(std::begin(kWords), std::end(kWords));
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

// A prompt = head + haystack + tail, the haystack being `units` joined by `sep` with the
// needles put in at the unit boundaries nearest their depths (by characters).
struct Layout {
  std::string head, tail, sep = " ";
  std::vector<std::string> units;
  std::vector<std::pair<double, std::string>> needles;  // (depth, text)
};

// The sample of layout `l` whose answer is `answers`, generating at most `max_tokens`.
Sample Assemble(const Layout& l, std::vector<std::string> answers, uint32_t max_tokens) {
  Sample s;
  size_t total = 0;
  std::vector<size_t> boundary = {0};  // character offset of each unit boundary
  for (const std::string& u : l.units) {
    total += u.size() + l.sep.size();
    boundary.push_back(total);
  }
  // Needle i goes before unit at[i] (at[i] == units.size(): at the end).
  std::vector<size_t> at(l.needles.size());
  for (size_t i = 0; i < l.needles.size(); ++i) {
    const double want = l.needles[i].first * static_cast<double>(total);
    const auto it = std::lower_bound(boundary.begin(), boundary.end(), want);
    size_t k = static_cast<size_t>(it - boundary.begin());
    if (k == boundary.size() || (k > 0 && want - static_cast<double>(boundary[k - 1]) <
                                              static_cast<double>(boundary[k]) - want)) {
      k = k == 0 ? 0 : k - 1;
    }
    at[i] = k;
  }
  s.prompt = l.head;
  s.haystack_begin = s.prompt.size();
  auto put_needles = [&](size_t k) {
    for (size_t i = 0; i < l.needles.size(); ++i) {
      if (at[i] != k) continue;
      s.needles.push_back({l.needles[i].second, s.prompt.size(), l.needles[i].first});
      s.prompt += l.needles[i].second;
      s.prompt += l.sep;
    }
  };
  for (size_t k = 0; k < l.units.size(); ++k) {
    put_needles(k);
    s.prompt += l.units[k];
    s.prompt += l.sep;
  }
  put_needles(l.units.size());
  s.haystack_end = s.prompt.size();
  s.prompt += l.tail;
  s.answers = std::move(answers);
  s.max_tokens = max_tokens;
  return s;
}

std::vector<std::string> NoiseUnits(size_t n) {
  std::vector<std::string> units;
  units.reserve(n);
  for (size_t i = 0; i < n; ++i) units.emplace_back(kNoise[i % std::size(kNoise)]);
  return units;
}

// The sample of the most units `make(n)` can have with its prompt at most `target` tokens.
// Tokens grow with n (up to a token merged across a boundary), so a doubling search and a
// bisection find it in ~2 log2(n) counts.
absl::StatusOr<Sample> Fit(const std::function<Sample(size_t)>& make, uint32_t target,
                           const TokenCounter& counter, std::string_view task) {
  auto fits = [&](size_t n) -> absl::StatusOr<bool> {
    KVR_ASSIGN_OR_RETURN(const uint32_t tokens, counter(make(n).prompt));
    return tokens <= target;
  };
  KVR_ASSIGN_OR_RETURN(bool ok, fits(0));
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(task), ": ", target,
                                                   " tokens cannot hold the task's question and "
                                                   "needles; ask for a longer length"));
  }
  size_t lo = 0, hi = 16;  // lo fits; double hi until it does not
  while (true) {
    KVR_ASSIGN_OR_RETURN(ok, fits(hi));
    if (!ok) break;
    lo = hi;
    hi *= 2;
    if (hi > (size_t{1} << 22)) return absl::InternalError("haystack does not grow in tokens");
  }
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    KVR_ASSIGN_OR_RETURN(ok, fits(mid));
    (ok ? lo : hi) = mid;
  }
  Sample s = make(lo);
  KVR_ASSIGN_OR_RETURN(s.prompt_tokens, counter(s.prompt));
  return s;
}

// Tokens to generate for an answer the model writes as `text`: its tokens by the served model's
// tokenizer and a margin (an opening colon or newline, a word more before it stops). Counted,
// not guessed: SmolLM2's tokenizer spends a token per digit, so four 7-digit numbers alone take
// 28 tokens and a fixed 28 cut the fourth one off.
absl::StatusOr<uint32_t> AnswerTokens(const TokenCounter& counter, const std::string& text) {
  constexpr uint32_t kMargin = 4;
  KVR_ASSIGN_OR_RETURN(const uint32_t tokens, counter(text));
  return tokens + kMargin;
}

constexpr std::string_view kNeedleIntro =
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards.\n";

absl::StatusOr<Sample> NiahSingle(const SampleSpec& spec, std::mt19937_64& rng,
                                  const TokenCounter& counter) {
  const std::string key = Number(rng, 100000, 9999999);  // 6 or 7 digits
  const double depth = kDepths[spec.index % std::size(kDepths)];
  auto make = [&](size_t n) {
    Layout l;
    l.head =
        "There is an important piece of information hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about it.\n";
    l.units = NoiseUnits(n);
    l.needles = {{depth, absl::StrCat("The pass key is ", key, ". Remember it. ", key,
                                      " is the pass key.")}};
    l.tail = "\nWhat is the pass key? The pass key is";
    return Assemble(l, {key}, 12);
  };
  return Fit(make, spec.target_tokens, counter, spec.task);
}

absl::StatusOr<Sample> NiahMultikey(const SampleSpec& spec, std::mt19937_64& rng,
                                    const TokenCounter& counter) {
  constexpr int kKeys = 4;
  const std::vector<std::string> keys = DistinctWords(rng, kKeys);
  std::vector<std::string> values;
  for (int i = 0; i < kKeys; ++i) values.push_back(Number(rng, 1000000, 9999999));
  const int asked = std::uniform_int_distribution<int>(0, kKeys - 1)(rng);
  std::vector<double> depths;
  for (int i = 0; i < kKeys; ++i) {
    depths.push_back(std::uniform_real_distribution<double>(0.05, 0.95)(rng));
  }
  auto make = [&](size_t n) {
    Layout l;
    l.head = std::string(kNeedleIntro);
    l.units = NoiseUnits(n);
    for (int i = 0; i < kKeys; ++i) {
      l.needles.push_back({depths[i], absl::StrCat("One of the special magic numbers for ", keys[i],
                                                   " is: ", values[i], ".")});
    }
    l.tail = absl::StrCat("\nWhat is the special magic number for ", keys[asked],
                          " mentioned in the provided text? The special magic number for ",
                          keys[asked], " mentioned in the provided text is");
    return Assemble(l, {values[asked]}, 16);
  };
  return Fit(make, spec.target_tokens, counter, spec.task);
}

absl::StatusOr<Sample> NiahMultivalue(const SampleSpec& spec, std::mt19937_64& rng,
                                      const TokenCounter& counter) {
  constexpr int kValues = 4;
  const std::string key = DistinctWords(rng, 1)[0];
  std::vector<std::string> values;
  std::vector<double> depths;
  for (int i = 0; i < kValues; ++i) {
    values.push_back(Number(rng, 1000000, 9999999));
    // One value per quarter of the haystack.
    depths.push_back((i + std::uniform_real_distribution<double>(0.1, 0.9)(rng)) / kValues);
  }
  KVR_ASSIGN_OR_RETURN(const uint32_t max_tokens,
                       AnswerTokens(counter, absl::StrCat(": ", absl::StrJoin(values, ", "), ".")));
  auto make = [&](size_t n) {
    Layout l;
    l.head = std::string(kNeedleIntro);
    l.units = NoiseUnits(n);
    for (int i = 0; i < kValues; ++i) {
      l.needles.push_back({depths[i], absl::StrCat("One of the special magic numbers for ", key,
                                                   " is: ", values[i], ".")});
    }
    l.tail = absl::StrCat("\nWhat are all the special magic numbers for ", key,
                          " mentioned in the provided text? The special magic numbers for ", key,
                          " mentioned in the provided text are");
    return Assemble(l, values, max_tokens);  // the four numbers, comma-separated
  };
  return Fit(make, spec.target_tokens, counter, spec.task);
}

absl::StatusOr<Sample> VariableTracking(const SampleSpec& spec, std::mt19937_64& rng,
                                        const TokenCounter& counter) {
  constexpr int kHops = 4;  // five variables per chain
  constexpr int kChains = 2;
  std::set<std::string> used;
  auto name = [&] {
    std::string n;
    do {
      n.clear();
      for (int i = 0; i < 5; ++i) {
        n += static_cast<char>('A' + std::uniform_int_distribution<int>(0, 25)(rng));
      }
    } while (!used.insert(n).second);
    return n;
  };
  std::vector<std::vector<std::string>> chains(kChains);
  std::vector<std::string> chain_values;
  for (auto& c : chains) {
    for (int i = 0; i <= kHops; ++i) c.push_back(name());
    std::string v;
    do {
      v = Number(rng, 10000, 99999);
    } while (!chain_values.empty() && v == chain_values[0]);
    chain_values.push_back(v);
  }
  // The statements in chain order, the two chains interleaved, spread over the haystack.
  std::vector<std::string> statements;
  for (int i = 0; i <= kHops; ++i) {
    for (int c = 0; c < kChains; ++c) {
      statements.push_back(
          i == 0 ? absl::StrCat("VAR ", chains[c][0], " = ", chain_values[c], ".")
                 : absl::StrCat("VAR ", chains[c][i], " = VAR ", chains[c][i - 1], "."));
    }
  }
  KVR_ASSIGN_OR_RETURN(
      const uint32_t max_tokens,
      AnswerTokens(counter, absl::StrCat(" ", absl::StrJoin(chains[0], ", "), ".")));
  auto make = [&](size_t n) {
    Layout l;
    l.head =
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n";
    l.units = NoiseUnits(n);
    for (size_t i = 0; i < statements.size(); ++i) {
      l.needles.push_back(
          {(static_cast<double>(i) + 0.5) / static_cast<double>(statements.size()), statements[i]});
    }
    l.tail = absl::StrCat(
        "\nQuestion: Find all variables that are assigned the value ", chain_values[0],
        " in the text above. Answer: According to the chain(s) of variable assignment in the text "
        "above, ",
        kHops + 1, " variables are assigned the value ", chain_values[0], ", they are:");
    return Assemble(l, chains[0], max_tokens);  // the five names, comma-separated
  };
  return Fit(make, spec.target_tokens, counter, spec.task);
}

absl::StatusOr<Sample> CommonWords(const SampleSpec& spec, std::mt19937_64& rng,
                                   const TokenCounter& counter) {
  std::vector<std::string> words(std::begin(kWords), std::end(kWords));
  std::shuffle(words.begin(), words.end(), rng);
  const std::string common = words.back();
  words.pop_back();
  const uint64_t list_seed = rng();
  auto make = [&](size_t n) {
    // Every other word appears at most ceil(n / words) times (round robin over a shuffled
    // order); the common one three times that and two more, so it is the most common by far.
    const size_t per = (n + words.size() - 1) / words.size();
    const size_t n_common = 3 * per + 2;
    std::mt19937_64 list_rng(list_seed);
    std::vector<std::string> order = words;
    std::shuffle(order.begin(), order.end(), list_rng);
    std::vector<std::string> list;
    for (size_t i = 0; i < n; ++i) list.push_back(order[i % order.size()]);
    for (size_t i = 0; i < n_common; ++i) list.push_back(common);
    std::shuffle(list.begin(), list.end(), list_rng);
    Layout l;
    l.head =
        "Below is a numbered list of words. In these words, one appears much more often than "
        "any other. Memorize the one that appears most often.\n";
    for (size_t i = 0; i < list.size(); ++i) l.units.push_back(absl::StrCat(i + 1, ". ", list[i]));
    l.tail =
        "\nQuestion: What is the most common word in the above list? Answer: The most common "
        "word in the above list is";
    Sample s = Assemble(l, {common}, 10);
    s.candidates = words;
    s.candidates.push_back(common);
    return s;
  };
  return Fit(make, spec.target_tokens, counter, spec.task);
}

absl::StatusOr<Sample> QaLicenses(const SampleSpec& spec, std::mt19937_64& rng,
                                  const TokenCounter& counter) {
  if (spec.corpus == nullptr || spec.corpus->empty()) {
    return absl::InvalidArgumentError("qa_licenses needs the lines of a text corpus");
  }
  const std::vector<std::string>& corpus = *spec.corpus;
  const size_t start = std::uniform_int_distribution<size_t>(0, corpus.size() - 1)(rng);
  const std::vector<std::string> names = DistinctWords(rng, 2);
  const std::string number = Number(rng, 100000, 999999);
  const double depth = kDepths[spec.index % std::size(kDepths)];
  const std::string thing = absl::StrCat(names[0], " ", names[1], " archive");
  auto make = [&](size_t n) {
    Layout l;
    l.head =
        "Read the following licence texts carefully. A fact about an archive is stated in "
        "them; you will be asked about it.\n\n";
    l.sep = "\n";
    for (size_t i = 0; i < n; ++i) l.units.push_back(corpus[(start + i) % corpus.size()]);
    l.needles = {
        {depth, absl::StrCat("The registration number of the ", thing, " is ", number, ".")}};
    l.tail = absl::StrCat("\nQuestion: What is the registration number of the ", thing,
                          "? Answer: The registration number of the ", thing, " is");
    return Assemble(l, {number}, 12);
  };
  return Fit(make, spec.target_tokens, counter, spec.task);
}

// Whole words of `text`: maximal runs of letters or of digits, lower case.
std::vector<std::string> Words(std::string_view text) {
  std::vector<std::string> out;
  std::string cur;
  int kind = 0;  // 1 letters, 2 digits
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    const int k = std::isalpha(c) ? 1 : std::isdigit(c) ? 2 : 0;
    if (k != kind && !cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
    kind = k;
    if (k != 0) cur += static_cast<char>(std::tolower(c));
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

}  // namespace

const std::vector<std::string>& TaskNames() {
  static const std::vector<std::string> names = {"niah_single",     "niah_multikey",
                                                 "niah_multivalue", "variable_tracking",
                                                 "common_words",    "qa_licenses"};
  return names;
}

absl::StatusOr<Sample> GenerateSample(const SampleSpec& spec, const TokenCounter& counter) {
  if (!counter) return absl::InvalidArgumentError("no token counter");
  std::mt19937_64 rng(SampleSeed(spec));
  absl::StatusOr<Sample> s;
  if (spec.task == "niah_single") {
    s = NiahSingle(spec, rng, counter);
  } else if (spec.task == "niah_multikey") {
    s = NiahMultikey(spec, rng, counter);
  } else if (spec.task == "niah_multivalue") {
    s = NiahMultivalue(spec, rng, counter);
  } else if (spec.task == "variable_tracking") {
    s = VariableTracking(spec, rng, counter);
  } else if (spec.task == "common_words") {
    s = CommonWords(spec, rng, counter);
  } else if (spec.task == "qa_licenses") {
    s = QaLicenses(spec, rng, counter);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown task '", spec.task, "' (tasks: ", absl::StrJoin(TaskNames(), ", "), ")"));
  }
  if (!s.ok()) return s.status();
  s->task = spec.task;
  s->index = spec.index;
  s->target_tokens = spec.target_tokens;
  return s;
}

absl::StatusOr<std::vector<std::string>> ReadCorpus(const std::string& dir,
                                                    std::vector<std::string>* names) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) files.push_back(e.path());
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(files.begin(), files.end());
  std::set<fs::path> seen;
  std::vector<std::string> lines;
  for (const fs::path& f : files) {
    const fs::path real = fs::canonical(f, ec);
    if (ec || !fs::is_regular_file(real) || !seen.insert(real).second) continue;
    std::ifstream in(real);
    if (!in) continue;
    if (names != nullptr) names->push_back(f.filename().string());
    std::string line;
    while (std::getline(in, line)) {
      absl::string_view t = absl::StripAsciiWhitespace(line);
      if (!t.empty()) lines.emplace_back(t);
    }
  }
  if (lines.empty()) return absl::NotFoundError(absl::StrCat("no text in ", dir));
  return lines;
}

double Score(const Sample& sample, std::string_view answer) {
  const std::vector<std::string> words = Words(answer);
  if (!sample.candidates.empty()) {
    const std::set<std::string> candidates(sample.candidates.begin(), sample.candidates.end());
    for (const std::string& w : words) {
      if (candidates.count(w) > 0) return w == absl::AsciiStrToLower(sample.answers[0]) ? 1 : 0;
    }
    return 0;
  }
  if (sample.answers.empty()) return 0;
  const std::set<std::string> found(words.begin(), words.end());
  int hits = 0;
  for (const std::string& a : sample.answers) hits += found.count(absl::AsciiStrToLower(a)) > 0;
  return static_cast<double>(hits) / static_cast<double>(sample.answers.size());
}

std::string NormalizeAnswer(std::string_view answer) {
  std::string out;
  bool space = false;
  for (char c : answer) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

}  // namespace kvr::eval_endpoint
