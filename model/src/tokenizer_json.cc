// Loading a Hugging Face tokenizer.json (+ tokenizer_config.json).

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvr/model/tokenizer.h"
#include "tokenizer_impl.h"

namespace kvr::model {
namespace {

using json = nlohmann::json;
using internal::Av;

absl::StatusOr<json> ReadJson(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream text;
  text << in.rdbuf();
  json parsed = json::parse(text.str(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(path, " is not valid JSON"));
  return parsed;
}

std::string TypeOf(const json& node) {
  if (!node.is_object() || !node.contains("type") || !node["type"].is_string()) return "";
  return node["type"].get<std::string>();
}

// PCRE2 quoting of a literal split string.
std::string QuoteLiteral(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// Appends the regex steps of a pre_tokenizer node. Only the node types byte-level BPE
// vocabularies use are accepted; anything else is refused by name rather than ignored.
absl::Status CollectPreTokenizer(const json& node, const std::string& path,
                                 std::vector<std::string>& patterns) {
  if (node.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(node);
  if (type == "Sequence") {
    if (!node.contains("pretokenizers") || !node["pretokenizers"].is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(path,
                                                     ": Sequence pre_tokenizer without a "
                                                     "pretokenizers list"));
    }
    for (const json& child : node["pretokenizers"]) {
      if (auto status = CollectPreTokenizer(child, path, patterns); !status.ok()) return status;
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    if (node.value("add_prefix_space", false)) {
      return absl::UnimplementedError(
          absl::StrCat(path, ": ByteLevel pre_tokenizer with add_prefix_space=true"));
    }
    if (node.value("use_regex", true)) patterns.emplace_back(internal::PreTokenizer::Gpt2Pattern());
    return absl::OkStatus();
  }
  if (type == "Digits") {
    patterns.push_back(node.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
    return absl::OkStatus();
  }
  if (type == "Split") {
    const std::string behavior = node.value("behavior", "");
    if (behavior != "Isolated" || node.value("invert", false)) {
      return absl::UnimplementedError(absl::StrCat(
          path, ": Split pre_tokenizer with behavior \"", behavior,
          "\" (invert=", node.value("invert", false), "); only Isolated is supported"));
    }
    const json& pattern = node.contains("pattern") ? node["pattern"] : json();
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      patterns.push_back(pattern["Regex"].get<std::string>());
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      patterns.push_back(QuoteLiteral(pattern["String"].get<std::string>()));
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": Split pre_tokenizer without a pattern"));
    }
    return absl::OkStatus();
  }
  return absl::UnimplementedError(
      absl::StrCat(path, ": pre_tokenizer type \"", type, "\" is not supported"));
}

// "content" of a special-token entry of tokenizer_config.json (a string or an AddedToken dict).
std::string TokenContent(const json& node) {
  if (node.is_string()) return node.get<std::string>();
  if (node.is_object() && node.contains("content") && node["content"].is_string()) {
    return node["content"].get<std::string>();
  }
  return "";
}

absl::StatusOr<internal::TokenizerParts> PartsFromTokenizerJsonUnchecked(const std::string& path) {
  auto root = ReadJson(path);
  if (!root.ok()) return root.status();
  const json& model = (*root).contains("model") ? (*root)["model"] : json();
  if (TypeOf(model) != "BPE") {
    return absl::UnimplementedError(
        absl::StrCat(path, ": model type \"", TypeOf(model), "\" is not supported (BPE only)"));
  }
  if (model.value("byte_fallback", false)) {
    return absl::UnimplementedError(absl::StrCat(path,
                                                 ": BPE with byte_fallback (SentencePiece "
                                                 "style) is not supported"));
  }
  bool nfc = false;
  if ((*root).contains("normalizer") && !(*root)["normalizer"].is_null()) {
    // NFC (Qwen2) is the one normaliser byte-level BPE vocabularies use.
    if (TypeOf((*root)["normalizer"]) != "NFC") {
      return absl::UnimplementedError(absl::StrCat(path, ": normalizer \"",
                                                   TypeOf((*root)["normalizer"]),
                                                   "\" is not supported (NFC only)"));
    }
    nfc = true;
  }
  const std::string decoder = (*root).contains("decoder") ? TypeOf((*root)["decoder"]) : "";
  if (decoder != "ByteLevel") {
    return absl::UnimplementedError(
        absl::StrCat(path, ": decoder \"", decoder, "\" is not supported (ByteLevel only)"));
  }

  internal::TokenizerParts parts;
  parts.nfc = nfc;
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": model.vocab is missing"));
  }
  int64_t max_id = -1;
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > (1 << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": vocab entry \"", token, "\" has a bad id ", id.dump()));
    }
    max_id = std::max<int64_t>(max_id, id.get<int64_t>());
  }
  const json added = (*root).contains("added_tokens") ? (*root)["added_tokens"] : json::array();
  for (const json& entry : added) {
    if (!entry.contains("id") || !entry["id"].is_number_integer() ||
        entry["id"].get<int64_t>() < 0 || !entry.contains("content") ||
        !entry["content"].is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": malformed added_tokens entry ", entry.dump()));
    }
    max_id = std::max<int64_t>(max_id, entry["id"].get<int64_t>());
  }
  if (max_id < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": empty vocabulary"));
  parts.tokens.assign(max_id + 1, "");
  parts.token_types.assign(max_id + 1, static_cast<int32_t>(TokenType::kNormal));
  for (const auto& [token, id] : model["vocab"].items()) parts.tokens[id.get<int64_t>()] = token;
  for (const json& entry : added) {
    if (entry.value("single_word", false)) {
      return absl::UnimplementedError(absl::StrCat(
          path, ": added token \"", entry["content"].get<std::string>(), "\" uses single_word"));
    }
    internal::AddedToken token;
    token.id = static_cast<int32_t>(entry["id"].get<int64_t>());
    token.content = entry["content"].get<std::string>();
    token.special = entry.value("special", false);
    token.lstrip = entry.value("lstrip", false);
    token.rstrip = entry.value("rstrip", false);
    parts.tokens[token.id] = token.content;
    parts.token_types[token.id] =
        static_cast<int32_t>(token.special ? TokenType::kControl : TokenType::kUserDefined);
    parts.added_tokens.push_back(std::move(token));
  }

  const json& merges = model.contains("merges") ? model["merges"] : json::array();
  parts.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& merge = merges[i];
    if (merge.is_string()) {
      // Legacy form "left right".
      const std::string text = merge.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": merges[", i, "] = \"", text,
                                                       "\" is not of the form \"left right\""));
      }
      parts.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      parts.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      return absl::InvalidArgumentError(absl::StrCat(path, ": merges[", i, "] is malformed"));
    }
  }
  parts.ignore_merges = model.value("ignore_merges", false);

  std::vector<std::string> patterns;
  const json pre = (*root).contains("pre_tokenizer") ? (*root)["pre_tokenizer"] : json();
  if (auto status = CollectPreTokenizer(pre, path, patterns); !status.ok()) return status;
  auto pre_tokenizer = internal::PreTokenizer::FromPatterns(patterns);
  if (!pre_tokenizer.ok()) return pre_tokenizer.status();
  parts.pre_tokenizer = std::move(*pre_tokenizer);
  parts.pre_name = "tokenizer.json";

  // A TemplateProcessing post-processor that starts with a special token is how Llama 3 adds
  // BOS; record it so that add_special reproduces it.
  const json post = (*root).contains("post_processor") ? (*root)["post_processor"] : json();
  if (TypeOf(post) == "TemplateProcessing" && post.contains("single") &&
      post["single"].is_array() && !post["single"].empty() &&
      post["single"][0].contains("SpecialToken")) {
    const std::string bos = post["single"][0]["SpecialToken"].value("id", "");
    for (const auto& token : parts.added_tokens) {
      if (token.content == bos) {
        parts.bos_id = token.id;
        parts.add_bos = true;
      }
    }
  }
  return parts;
}

// nlohmann::json throws on a value of an unexpected type; turn that into a Status here so
// that no exception leaves the library (CONVENTIONS.md 3).
absl::StatusOr<internal::TokenizerParts> PartsFromTokenizerJson(const std::string& path) {
  try {
    return PartsFromTokenizerJsonUnchecked(path);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected structure: ", e.what()));
  }
}

int32_t FindAdded(const internal::TokenizerParts& parts, const std::string& content) {
  for (const auto& token : parts.added_tokens) {
    if (token.content == content) return token.id;
  }
  return -1;
}

// Without tokenizer_config.json the special tokens are inferred from conventional names.
void GuessSpecialIds(internal::TokenizerParts& parts) {
  if (parts.bos_id < 0) {
    for (const char* name : {"<|begin_of_text|>", "<s>", "<|startoftext|>"}) {
      if ((parts.bos_id = FindAdded(parts, name)) >= 0) break;
    }
  }
  if (parts.eos_id < 0) {
    for (const char* name : {"<|end_of_text|>", "</s>", "<|endoftext|>"}) {
      if ((parts.eos_id = FindAdded(parts, name)) >= 0) break;
    }
  }
}

}  // namespace

// Defined here (not in the anonymous namespace) because it calls the private constructor.
absl::StatusOr<Tokenizer> Tokenizer::FromTokenizerJson(const std::string& path) {
  auto parts = PartsFromTokenizerJson(path);
  if (!parts.ok()) return parts.status();
  GuessSpecialIds(*parts);
  auto impl = internal::BuildTokenizerImpl(std::move(*parts));
  if (!impl.ok()) return impl.status();
  return Tokenizer(std::move(*impl));
}

absl::StatusOr<Tokenizer> Tokenizer::FromHuggingFaceDir(const std::string& dir) {
  const std::string tokenizer_path = (std::filesystem::path(dir) / "tokenizer.json").string();
  auto parts = PartsFromTokenizerJson(tokenizer_path);
  if (!parts.ok()) return parts.status();
  const std::filesystem::path config_path = std::filesystem::path(dir) / "tokenizer_config.json";
  if (std::filesystem::exists(config_path)) try {
      auto config = ReadJson(config_path.string());
      if (!config.ok()) return config.status();
      auto special_id = [&](const char* key, int32_t& id) -> absl::Status {
        if (!config->contains(key) || (*config)[key].is_null()) return absl::OkStatus();
        const std::string content = TokenContent((*config)[key]);
        id = FindAdded(*parts, content);
        if (id < 0) {
          return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": ", key, " \"",
                                                         content, "\" is not an added token"));
        }
        return absl::OkStatus();
      };
      if (auto s = special_id("bos_token", parts->bos_id); !s.ok()) return s;
      if (auto s = special_id("eos_token", parts->eos_id); !s.ok()) return s;
      if (auto s = special_id("unk_token", parts->unk_id); !s.ok()) return s;
      if (auto s = special_id("pad_token", parts->pad_id); !s.ok()) return s;
      if (config->contains("add_bos_token") && (*config)["add_bos_token"].is_boolean()) {
        parts->add_bos = (*config)["add_bos_token"].get<bool>() || parts->add_bos;
      }
      if (config->contains("add_eos_token") && (*config)["add_eos_token"].is_boolean()) {
        parts->add_eos = (*config)["add_eos_token"].get<bool>();
      }
      if (config->contains("chat_template")) {
        const json& chat = (*config)["chat_template"];
        if (chat.is_string()) {
          parts->chat_template = chat.get<std::string>();
        } else if (chat.is_array()) {
          // Named templates: [{"name": "default", "template": "..."}, ...].
          for (const json& entry : chat) {
            if (entry.value("name", "") == "default" && entry.contains("template")) {
              parts->chat_template = entry["template"].get<std::string>();
            }
          }
        }
      }
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(config_path.string(), ": unexpected structure: ", e.what()));
    }
  GuessSpecialIds(*parts);
  auto impl = internal::BuildTokenizerImpl(std::move(*parts));
  if (!impl.ok()) return impl.status();
  return Tokenizer(std::move(*impl));
}

}  // namespace kvr::model
