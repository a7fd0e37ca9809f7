// kvr tokenize: shows how a model's tokenizer splits a text, one token per line (index, id,
// piece), optionally through the chat template and with special tokens written in the text
// recognised. Loads only the tokenizer, not the weights.

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "commands.h"
#include "kvr/common/paths.h"
#include "kvr/common/status.h"
#include "kvr/model/gguf.h"
#include "kvr/model/loader.h"
#include "kvr/model/tokenizer.h"

namespace kvr::tools {
namespace {

struct TokenizeOptions {
  std::string model = "smollm2-135m-instruct";
  std::string text;
  std::string file;
  bool chat = false;
  bool no_add_special = false;
  bool parse_special = false;
  bool ids_only = false;
};

absl::StatusOr<model::Tokenizer> LoadTokenizer(const std::string& name) {
  const std::string path = name == "smollm2-135m-instruct" ? TestModelPath() : name;
  if (std::filesystem::is_directory(path)) return model::Tokenizer::FromHuggingFaceDir(path);
  KVR_ASSIGN_OR_RETURN(model::GgufFile file, model::GgufFile::Open(path));
  KVR_ASSIGN_OR_RETURN(model::TokenizerSpec spec, model::TokenizerSpecFromGguf(file));
  return model::Tokenizer::FromGgufMetadata(spec);
}

// A piece with control and non-printable bytes escaped, so that every token is one line.
std::string Printable(std::string_view piece) {
  std::string out;
  for (unsigned char ch : piece) {
    if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (ch == '\\') {
      out += "\\\\";
    } else if (ch < 0x20 || ch == 0x7f) {
      out += absl::StrCat("\\x", absl::Hex(ch, absl::kZeroPad2));
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out;
}

absl::Status RunTokenize(const TokenizeOptions& o) {
  std::string text = o.text;
  if (!o.file.empty()) {
    std::ifstream in(o.file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read --file ", o.file));
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  KVR_ASSIGN_OR_RETURN(model::Tokenizer tokenizer, LoadTokenizer(o.model));
  model::EncodeOptions encode{.add_special = !o.no_add_special, .parse_special = o.parse_special};
  if (o.chat) {
    const model::ChatMessage message{"user", text};
    KVR_ASSIGN_OR_RETURN(text, tokenizer.ApplyChatTemplate(std::span(&message, 1), true));
    // The rendered template already holds its special tokens as text.
    encode = {.add_special = false, .parse_special = true};
  }
  KVR_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(text, encode));
  if (o.ids_only) {
    std::printf("%s\n", absl::StrJoin(ids, " ").c_str());
    return absl::OkStatus();
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    // The vocabulary's own piece (byte-level pieces show as the vocabulary spells them) and
    // the text it decodes to.
    KVR_ASSIGN_OR_RETURN(std::string_view piece, tokenizer.IdToPiece(ids[i]));
    KVR_ASSIGN_OR_RETURN(std::string decoded, tokenizer.Decode(std::span(&ids[i], 1)));
    std::printf("%zu\t%d\t%s\t%s\n", i, ids[i], Printable(piece).c_str(),
                Printable(decoded).c_str());
  }
  std::fprintf(stderr, "%zu tokens (%s%s%s)\n", ids.size(), o.chat ? "chat template, " : "",
               encode.add_special ? "BOS/EOS added as the tokenizer does" : "no BOS/EOS added",
               encode.parse_special ? ", special tokens in the text recognised" : "");
  return absl::OkStatus();
}

}  // namespace

void AddTokenizeCommand(CLI::App& app) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "print the tokens of a text: index, id, vocabulary piece, decoded text");
  cmd->add_option("--model", options->model,
                  "GGUF file, Hugging Face directory or a known name (smollm2-135m-instruct); "
                  "only its tokenizer is loaded")
      ->capture_default_str();
  cmd->add_option("--text", options->text, "the text to tokenize");
  cmd->add_option("--file", options->file, "read the text from this file");
  cmd->add_flag("--chat", options->chat,
                "wrap the text as a user message in the model's chat template first");
  cmd->add_flag("--no-add-special", options->no_add_special,
                "do not add the tokenizer's BOS/EOS tokens (ignored with --chat)");
  cmd->add_flag("--parse-special", options->parse_special,
                "recognise special tokens written in the text (e.g. <|im_start|>) instead of "
                "splitting them as plain text (always on with --chat)");
  cmd->add_flag("--ids-only", options->ids_only, "print only the ids, space-separated");
  cmd->callback([options] { ExitIfError("tokenize", RunTokenize(*options)); });
}

}  // namespace kvr::tools
