// kvr up: a local cluster in child processes: kvr-controller, N kvr-store, N kvr-prefill and
// N kvr-decode. Waits until every node registered, prints the endpoints, stays in the foreground
// and stops the children on SIGINT/SIGTERM (each child also gets SIGTERM if kvr up dies:
// PR_SET_PDEATHSIG).
//
// Every node registers itself with the controller (kvr-store too, given --controller); kvr up
// waits for every store's "kvr-store registered" line and for ListModels to show every prefill
// and decode node.

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "commands.h"
#include "kvr/common/cert_authority.h"
#include "kvr/common/line_reader.h"
#include "kvr/common/status.h"
#include "kvr/common/tls.h"
#include "kvr/node/settings.h"
#include "kvr/v1/generation.grpc.pb.h"

namespace kvr::tools {
namespace {

struct UpOptions {
  std::string model = "smollm2-135m-instruct";
  int prefill = 1;
  int decode = 1;
  int stores = 1;
  int base_port = 50051;  // 0: every process picks a free port
  uint64_t store_capacity = uint64_t{1} << 30;
  std::string bin_dir;
  std::string log_dir;
  double ready_timeout_s = 180;
  bool detach = false;
  std::string pid_file;
  std::vector<std::string> controller_args;
  std::vector<std::string> store_args;
  std::vector<std::string> prefill_args;
  std::vector<std::string> decode_args;
  std::string a2ats_codebooks;  // given to every prefill and decode node
  std::string device = "cpu";   // --device of every prefill and decode node
  std::string store_dtype;      // --store-dtype of every prefill node; empty: the node's default
  bool insecure = false;  // plaintext gRPC and HTTP everywhere instead of the throw-away CA's TLS
};

// The throw-away PKI of a secured local cluster, in <log dir>/tls: a CA made for this run and
// one certificate per process (SANs 127.0.0.1 and localhost, where every process listens, and
// kvr://node/<its name>), plus "client" for kvr generate / kvr bench / tests. The CA's key
// stays in the directory (0600) so that a restarted process of this run can be given a
// certificate; the whole directory is worth nothing after the run.
class LocalPki {
 public:
  static absl::StatusOr<LocalPki> Create(const std::string& dir) {
    LocalPki pki;
    pki.dir_ = dir;
    absl::StatusOr<PemCertificate> ca =
        GenerateCertificateAuthority("kvr up local cluster CA", kValidity);
    if (!ca.ok()) return ca.status();
    pki.ca_ = *std::move(ca);
    absl::StatusOr<TlsConfig> files =
        WriteCertificate(dir, "ca", pki.ca_, absl::StrCat(dir, "/ca.pem"));
    if (!files.ok()) return files.status();
    pki.ca_file_ = files->cert_file;
    return pki;
  }
  // A certificate for the process `name`, written beside the CA. It names the node
  // (kvr://node/<name>): each node registers under the name kvr up gives it, which the
  // controller checks against its certificate.
  absl::StatusOr<TlsConfig> Issue(const std::string& name) const {
    absl::StatusOr<PemCertificate> cert =
        IssueCertificate(ca_, name, {"127.0.0.1", "localhost"}, kValidity, {NodeIdentityUri(name)});
    if (!cert.ok()) return cert.status();
    return WriteCertificate(dir_, name, *cert, ca_file_);
  }
  // --tls-ca, --tls-cert and --tls-key for `name`'s command line.
  absl::StatusOr<std::vector<std::string>> Flags(const std::string& name) const {
    absl::StatusOr<TlsConfig> tls = Issue(name);
    if (!tls.ok()) return tls.status();
    return std::vector<std::string>{"--tls-ca=" + tls->ca_file, "--tls-cert=" + tls->cert_file,
                                    "--tls-key=" + tls->key_file};
  }
  const std::string& ca_file() const { return ca_file_; }

 private:
  static constexpr absl::Duration kValidity = absl::Hours(24 * 30);
  std::string dir_;
  std::string ca_file_;
  PemCertificate ca_;
};

// A child process whose stdout lines are copied into its log file and scanned for the lines
// the kvr binaries print at start ("... listening on HOST:PORT", "... metrics on HOST:PORT",
// "kvr-store listening port=N"). stderr goes to the log file directly.
class Child {
 public:
  Child(std::string name, std::vector<std::string> argv, const std::string& log_path)
      : name_(std::move(name)), argv_(std::move(argv)) {
    // Close-on-exec: later children must not inherit this pipe, or its reader would never see
    // EOF when this child dies (dup2 below clears the flag on the child's own stdout).
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return;
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      // The child: die with kvr up, start with the default signal mask (kvr up blocks
      // SIGINT/SIGTERM for sigwait, and exec keeps the mask).
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      setpgid(0, 0);  // Ctrl-C in the terminal reaches kvr up only; it stops us in order
      dup2(fds[1], STDOUT_FILENO);
      if (log >= 0) dup2(log, STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<char*> args;
      for (std::string& a : argv_) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      std::perror(("exec " + argv_[0]).c_str());
      _exit(127);
    }
    close(fds[1]);
    stdout_ = std::make_unique<LineReader>(fds[0], log);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { Stop(absl::Seconds(5)); }  // then stdout_ reads to EOF

  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }

  // Waits for a line containing `marker` and returns what follows it ("" on timeout or exit).
  std::string WaitFor(const std::string& marker, absl::Duration timeout) {
    if (stdout_ == nullptr) return "";
    const std::optional<std::string> line = stdout_->Await(
        [&](const std::string& l) { return l.find(marker) != std::string::npos; }, timeout);
    return line ? line->substr(line->find(marker) + marker.size()) : "";
  }
  // What follows `marker` if such a line was printed already.
  std::string Find(const std::string& marker) { return WaitFor(marker, absl::ZeroDuration()); }
  bool exited() { return stdout_ == nullptr || stdout_->eof(); }

  // SIGTERM, then SIGKILL after `grace`; reaps the child.
  void Stop(absl::Duration grace) {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    const absl::Time give_up = absl::Now() + grace;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (absl::Now() > give_up) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    pid_ = -1;
  }

 private:
  std::string name_;
  std::vector<std::string> argv_;
  pid_t pid_ = -1;
  std::unique_ptr<LineReader> stdout_;  // null when the pipe could not be made
};

// The binary `name`: next to kvr, in the build tree's component folder, or on PATH.
std::optional<std::string> FindBinary(const std::string& name, const std::string& folder,
                                      const std::string& bin_dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (!bin_dir.empty()) candidates.push_back(fs::path(bin_dir) / name);
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(self.parent_path() / name);
    candidates.push_back(self.parent_path().parent_path() / folder / name);  // build/tools/kvr
  }
  if (const char* path = std::getenv("PATH")) {
    std::string p = path;
    size_t start = 0;
    while (start <= p.size()) {
      const size_t end = std::min(p.find(':', start), p.size());
      if (end > start) candidates.push_back(fs::path(p.substr(start, end - start)) / name);
      start = end + 1;
    }
  }
  for (const fs::path& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c.string();
  }
  return std::nullopt;
}

std::string Port(const UpOptions& o, int offset) {
  return o.base_port == 0 ? "0" : std::to_string(o.base_port + offset);
}

// Port offsets from --base-port: store 0 at +1 (beside the controller), further stores from +51.
int StorePortOffset(int i) { return i == 0 ? 1 : 50 + i; }

// "see LOG" plus why the child stopped, so the reason shows without opening the file: the log's
// error lines (an absl status code name, an [error]/[critical] log line, "terminate called"),
// else its last lines (a node prints its effective config after an early error, so the last
// lines alone would hide it).
std::string SeeLog(const std::string& path, size_t n = 6) {
  static const std::regex kError(
      "(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
      "PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
      "UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): |\\[(error|critical)\\]|"
      "terminate called|Address already in use");
  std::ifstream in(path);
  std::vector<std::string> lines, errors;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    if (std::regex_search(line, kError)) errors.push_back(line);
    lines.push_back(std::move(line));
  }
  const std::vector<std::string>& shown = errors.empty() ? lines : errors;
  std::string out = absl::StrCat("see ", path);
  if (shown.empty()) return out;
  absl::StrAppend(&out, errors.empty() ? "; its last lines:" : "; it says:");
  for (size_t i = shown.size() > n ? shown.size() - n : 0; i < shown.size(); ++i) {
    absl::StrAppend(&out, "\n  | ", shown[i]);
  }
  return out;
}

absl::Status RunUp(const UpOptions& o, int ready_fd) {
  // Blocked before any thread starts, so that sigwait below gets them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  struct Bin {
    const char* name;
    const char* folder;
    std::string path;
  };
  Bin bins[] = {{"kvr-controller", "controller", ""},
                {"kvr-store", "kv-store", ""},
                {"kvr-prefill", "prefill-node", ""},
                {"kvr-decode", "decode-node", ""}};
  for (Bin& b : bins) {
    std::optional<std::string> p = FindBinary(b.name, b.folder, o.bin_dir);
    if (!p) {
      return absl::NotFoundError(absl::StrCat(b.name, " not found next to kvr, in the build tree (",
                                              b.folder,
                                              "/) or on PATH; build it or pass --bin-dir"));
    }
    b.path = *p;
  }
  const std::string log_dir =
      o.log_dir.empty() ? absl::StrCat("/tmp/kvr-up-", getpid()) : o.log_dir;
  std::filesystem::create_directories(log_dir);
  auto log = [&](const std::string& name) { return absl::StrCat(log_dir, "/", name, ".log"); };
  const absl::Duration start_timeout = absl::Seconds(o.ready_timeout_s);
  // UCX opens a TCP listener on every network interface it finds; a local cluster keeps its
  // data plane on loopback (shared memory between its processes, TCP over lo), so the
  // children inherit UCX_NET_DEVICES=lo unless the operator chose devices.
  if (getenv("UCX_NET_DEVICES") == nullptr) setenv("UCX_NET_DEVICES", "lo", 1);
  // The children's TLS files come from this run's flags alone: a KVR_*TLS_* left in the
  // environment (KVR_TLS_CA for kvr generate, which the controller also reads as its older
  // spelling) must not reach them (with --insecure it would make them TLS servers without a
  // certificate).
  for (const char* role : {"", "CONTROLLER_", "STORE_", "PREFILL_", "DECODE_"}) {
    for (const char* file : {"CA", "CERT", "KEY"}) {
      unsetenv(absl::StrCat("KVR_", role, "TLS_", file).c_str());
    }
  }

  // Every gRPC channel is TLS with certificates of a CA made for this run, unless --insecure:
  // nodes and stores present theirs to each other and to the controller, which admits no
  // member without one. The controller's port also serves the public API: its clients need
  // the CA (--tls-ca, printed below) but no certificate. The HTTP API is HTTPS with the
  // controller's certificate.
  std::optional<LocalPki> pki;
  TlsConfig client_tls;
  auto tls_flags = [&](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    if (!pki) return std::vector<std::string>{};
    return pki->Flags(name);
  };
  if (!o.insecure) {
    absl::StatusOr<LocalPki> created = LocalPki::Create(absl::StrCat(log_dir, "/tls"));
    if (!created.ok()) return created.status();
    pki = *std::move(created);
    absl::StatusOr<TlsConfig> client = pki->Issue("client");
    if (!client.ok()) return client.status();
    client_tls = *client;
  }
  absl::StatusOr<GrpcSecurity> client_security = GrpcSecurity::Load(client_tls);
  if (!client_security.ok()) return client_security.status();

  // Controller first: everyone registers with it.
  std::vector<std::unique_ptr<Child>> nodes;
  // The OpenAI-compatible HTTP API on loopback beside the gRPC port. An API key reaches
  // the controller through the inherited environment (KVR_CONTROLLER_API_KEY), not its
  // command line.
  std::vector<std::string> controller_argv = {
      bins[0].path, "--listen", absl::StrCat("127.0.0.1:", Port(o, 0)), "--http-listen",
      absl::StrCat("127.0.0.1:", Port(o, 2))};
  if (pki) {
    // The controller's certificate serves both its gRPC port and HTTPS (its SANs are the
    // loopback names both listen on); OpenAI clients trust the CA printed below.
    KVR_ASSIGN_OR_RETURN(TlsConfig controller_tls, pki->Issue("controller"));
    controller_argv.insert(
        controller_argv.end(),
        {"--tls-ca=" + controller_tls.ca_file, "--tls-cert=" + controller_tls.cert_file,
         "--tls-key=" + controller_tls.key_file, "--http-tls-cert=" + controller_tls.cert_file,
         "--http-tls-key=" + controller_tls.key_file});
  }
  controller_argv.insert(controller_argv.end(), o.controller_args.begin(), o.controller_args.end());
  auto controller = std::make_unique<Child>("controller", controller_argv, log("controller"));
  const std::string controller_address =
      controller->WaitFor("kvr-controller listening on ", start_timeout);
  if (controller_address.empty()) {
    return absl::UnavailableError(
        absl::StrCat("kvr-controller did not start; ", SeeLog(log("controller"))));
  }
  std::vector<std::unique_ptr<Child>> stores;
  std::vector<std::string> store_addresses;
  for (int i = 0; i < o.stores; ++i) {
    const std::string name = absl::StrCat("store-", i);
    KVR_ASSIGN_OR_RETURN(std::vector<std::string> store_tls, tls_flags(name));
    std::vector<std::string> store_argv = {
        bins[1].path, "--listen", absl::StrCat("127.0.0.1:", Port(o, StorePortOffset(i))),
        "--capacity-bytes", std::to_string(o.store_capacity),
        // Sequences of a node that died mid-request are dropped when their lease runs out.
        "--evict-expired", "true", "--sweep-interval-ms", "500",
        // It registers itself (role STORE) and heartbeats its free bytes and sequences.
        "--controller", controller_address,
        // Same-host readers (a CUDA decode node) map its page pool through this socket
        // and read rows in place.
        "--local-socket", absl::StrCat(log_dir, "/", name, ".sock"),
        // One name per node: kvr up's, the node's metrics label and its registration.
        "--name", name};
    store_argv.insert(store_argv.end(), store_tls.begin(), store_tls.end());
    store_argv.insert(store_argv.end(), o.store_args.begin(), o.store_args.end());
    stores.push_back(std::make_unique<Child>(name, store_argv, log(name)));
  }
  for (int i = 0; i < o.stores; ++i) {
    const std::string name = stores[i]->name();
    const std::string port = stores[i]->WaitFor("kvr-store listening port=", start_timeout);
    if (port.empty()) {
      return absl::UnavailableError(
          absl::StrCat("kvr-store ", name, " did not start; ", SeeLog(log(name))));
    }
    store_addresses.push_back(absl::StrCat("127.0.0.1:", port.substr(0, port.find(' '))));
  }

  // The command line of node `name` (a prefill or decode node): the flags both roles take,
  // `role_flags`, its TLS files and the user's `extra_args` for the role, in that order.
  const auto start_node = [&](const std::string& binary, const char* name_flag,
                              const std::string& name, const std::string& port,
                              const std::vector<std::string>& role_flags,
                              const std::vector<std::string>& extra_args) -> absl::Status {
    std::vector<std::string> argv = {binary,
                                     name_flag,
                                     name,
                                     "--model",
                                     o.model,
                                     "--controller",
                                     controller_address,
                                     "--listen",
                                     absl::StrCat("127.0.0.1:", port)};
    if (!o.a2ats_codebooks.empty()) argv.push_back("--a2ats-codebooks=" + o.a2ats_codebooks);
    argv.push_back("--device=" + o.device);
    argv.insert(argv.end(), role_flags.begin(), role_flags.end());
    KVR_ASSIGN_OR_RETURN(std::vector<std::string> node_tls, tls_flags(name));
    argv.insert(argv.end(), node_tls.begin(), node_tls.end());
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    nodes.push_back(std::make_unique<Child>(name, argv, log(name)));
    return absl::OkStatus();
  };
  std::vector<std::string> prefill_flags;
  if (!o.store_dtype.empty()) prefill_flags.push_back("--store-dtype=" + o.store_dtype);
  // A CUDA decode node reads the rows in the store's dtype: fp8 rows take its fp8 row format.
  std::vector<std::string> decode_flags;
  if (o.device == "cuda" && o.store_dtype == "fp8") decode_flags.push_back("--gpu-row-format=fp8");
  for (int i = 0; i < o.prefill; ++i) {
    KVR_RETURN_IF_ERROR(start_node(bins[2].path, "--node-name", absl::StrCat("prefill-", i),
                                   Port(o, 10 + i), prefill_flags, o.prefill_args));
  }
  for (int i = 0; i < o.decode; ++i) {
    KVR_RETURN_IF_ERROR(start_node(bins[3].path, "--name", absl::StrCat("decode-", i),
                                   Port(o, 30 + i), decode_flags, o.decode_args));
  }

  // Ready when the store registered and ListModels shows every prefill and decode node.
  auto generation =
      kvr::v1::Generation::NewStub(client_security->CreateChannel(controller_address));
  const absl::Time give_up = absl::Now() + start_timeout;
  std::string model_name;
  std::vector<std::string> store_ids(stores.size());
  auto stores_registered = [&] {
    for (const std::string& id : store_ids) {
      if (id.empty()) return false;
    }
    return true;
  };
  while (model_name.empty() || !stores_registered()) {
    for (size_t i = 0; i < stores.size(); ++i) {
      if (stores[i]->exited()) {
        return absl::UnavailableError(absl::StrCat(stores[i]->name(), " exited during start-up; ",
                                                   SeeLog(log(stores[i]->name()))));
      }
      store_ids[i] = stores[i]->Find("kvr-store registered ");
    }
    for (auto& n : nodes) {
      if (n->exited()) {
        return absl::UnavailableError(
            absl::StrCat(n->name(), " exited during start-up; ", SeeLog(log(n->name()))));
      }
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("the nodes did not all register within ", o.ready_timeout_s, " s (stores ",
                       stores_registered() ? "registered" : "not all registered", "); logs in ",
                       log_dir));
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    kvr::v1::ListModelsResponse models;
    if (generation->ListModels(&ctx, {}, &models).ok()) {
      for (const kvr::v1::ModelCard& card : models.models()) {
        if (static_cast<int>(card.prefill_nodes()) >= o.prefill &&
            static_cast<int>(card.decode_nodes()) >= o.decode) {
          model_name = card.name();
        }
      }
    }
    if (model_name.empty() || !stores_registered()) absl::SleepFor(absl::Milliseconds(200));
  }

  // "https listening on" when the controller serves HTTPS (kvr up's default).
  std::string http_base_url;
  if (const std::string https = controller->Find("https listening on "); !https.empty()) {
    http_base_url = absl::StrCat("https://", https, "/v1");
  } else if (const std::string http = controller->Find("http listening on "); !http.empty()) {
    http_base_url = absl::StrCat("http://", http, "/v1");
  }
  std::string report = absl::StrFormat(
      "kvr cluster up: model '%s', %d prefill + %d decode node(s), %d store(s)\n"
      "  public gRPC (kvr.v1.Generation)  %s\n"
      "  OpenAI-compatible HTTP           %s\n"
      "  %-12s pid %-7d grpc %-21s metrics %s\n",
      model_name, o.prefill, o.decode, o.stores, controller_address,
      http_base_url.empty() ? "-" : http_base_url,
      "controller", controller->pid(), controller_address,
      controller->Find("metrics on ").empty() ? "-" : controller->Find("metrics on "));
  for (size_t i = 0; i < stores.size(); ++i) {
    const std::string metrics = stores[i]->Find("kvr-store metrics port=");
    absl::StrAppendFormat(&report, "  %-12s pid %-7d grpc %-21s metrics %s (registered as %s)\n",
                          stores[i]->name(), stores[i]->pid(), store_addresses[i],
                          metrics.empty() ? "-" : absl::StrCat("127.0.0.1:", metrics),
                          store_ids[i]);
  }
  for (auto& n : nodes) {
    const std::string grpc_address = n->Find("listening on ");
    const std::string metrics = n->Find("metrics on ");
    absl::StrAppendFormat(&report, "  %-12s pid %-7d grpc %-21s metrics %s\n", n->name(), n->pid(),
                          grpc_address, metrics.empty() ? "-" : metrics);
  }
  if (pki) {
    // Parseable: "tls ca PATH" and "tls client CERT KEY" (tests read them).
    absl::StrAppend(&report, "  tls ca ", pki->ca_file(),
                    "\n    (gRPC and the HTTP API are TLS: kvr generate --endpoint / kvr bench "
                    "need --tls-ca PATH or KVR_TLS_CA=PATH; OpenAI clients trust PATH, e.g. "
                    "OpenAI(http_client=openai.DefaultHttpxClient(verify=PATH)))\n");
    absl::StrAppend(&report, "  tls client ", client_tls.cert_file, " ", client_tls.key_file,
                    "\n    (a certificate for calls to the nodes' own ports)\n");
  } else {
    absl::StrAppend(&report,
                    "  tls off (--insecure): every gRPC channel and the HTTP API are plaintext\n");
  }
  absl::StrAppend(&report, "  logs ", log_dir, "\n", "kvr up: ready (Ctrl-C stops the cluster)\n");
  std::cout << report << std::flush;
  if (ready_fd >= 0) {
    (void)!write(ready_fd, report.data(), report.size());
    close(ready_fd);
  }

  int received = 0;
  sigwait(&signals, &received);
  std::cout << "kvr up: signal " << received << ", stopping the cluster" << std::endl;
  // Nodes first (they deregister), then the store, then the controller.
  for (auto& n : nodes) kill(n->pid(), SIGTERM);
  for (auto& n : nodes) n->Stop(absl::Seconds(8));
  for (auto& st : stores) kill(st->pid(), SIGTERM);
  for (auto& st : stores) st->Stop(absl::Seconds(5));  // they deregister
  // An open client channel holds the controller's graceful shutdown for its whole grace period.
  generation.reset();
  controller->Stop(absl::Seconds(12));
  std::cout << "kvr up: stopped" << std::endl;
  return absl::OkStatus();
}

}  // namespace

// kvr up's settings: flags or a --config YAML file, through the same table as the nodes'
// (kvr/node/settings.h). No environment: KVR_* variables are left to the nodes, which inherit
// them.
const node::SettingTable<UpOptions>& UpSettings() {
  using Config = UpOptions;
  using node::BoolSetting;
  using node::EnumSetting;
  using node::IntegerSetting;
  using node::ListSetting;
  using node::StringSetting;
  // Immutable after construction; a function-local static is a constant, not mutable state.
  static const node::SettingTable<Config>* const table = [] {
    node::Setting<Config> codebooks = StringSetting<Config>(
        "a2ats_codebooks",
        "`kvr calibrate` file for the model: prefill and decode nodes offer a2ats",
        &Config::a2ats_codebooks, /*allow_empty=*/true);
    codebooks.store = [](Config& c, const node::SettingValue& v) {
      const std::string& path = std::get<std::string>(v);
      if (!path.empty() && !std::filesystem::is_regular_file(path)) {
        return absl::InvalidArgumentError(absl::StrCat("no file ", path));
      }
      c.a2ats_codebooks = path;
      return absl::OkStatus();
    };
    return new node::SettingTable<Config>{
        .program = "kvr up",
        .settings =
            {
                StringSetting<Config>("model", "model for the nodes: GGUF path or known name",
                                      &Config::model),
                IntegerSetting<Config>("prefill", "prefill nodes", &Config::prefill, 1),
                IntegerSetting<Config>("decode", "decode nodes", &Config::decode, 1),
                IntegerSetting<Config>("stores", "KV store processes (placement spreads sequences)",
                                       &Config::stores, 1, 40),
                IntegerSetting<Config>("base_port",
                                       "controller port; store +1 (more stores +51..), OpenAI HTTP "
                                       "+2, prefill +10.., decode +30.. (0: free ports)",
                                       &Config::base_port, 0, 65535),
                node::ByteSizeSetting<Config>("store_capacity", "KV store page pool of each store",
                                              &Config::store_capacity),
                StringSetting<Config>("bin_dir", "where the kvr-* binaries are (empty: found)",
                                      &Config::bin_dir, /*allow_empty=*/true),
                StringSetting<Config>("log_dir", "node logs (empty: /tmp/kvr-up-<pid>)",
                                      &Config::log_dir, /*allow_empty=*/true),
                node::SecondsSetting<Config>("ready_timeout", "how long to wait for registration",
                                             &Config::ready_timeout_s),
                ListSetting<Config>("controller_arg",
                                    "extra argument for kvr-controller (e.g. "
                                    "--controller-arg=--prefix-cache-seconds=60)",
                                    &Config::controller_args),
                ListSetting<Config>("store_arg", "extra argument for every kvr-store",
                                    &Config::store_args),
                ListSetting<Config>("prefill_arg", "extra argument for every kvr-prefill",
                                    &Config::prefill_args),
                ListSetting<Config>("decode_arg", "extra argument for every kvr-decode",
                                    &Config::decode_args),
                std::move(codebooks),
                EnumSetting<Config>(
                    "device",
                    "where prefill and decode nodes run the model (cuda: GPU 0; node "
                    "settings such as --gpu-budget go through --prefill-arg / "
                    "--decode-arg)",
                    &Config::device, {"cpu", "cuda"}),
                EnumSetting<Config>(
                    "store_dtype",
                    "element type of the KV rows the prefill nodes put to the store "
                    "(empty: the nodes' own, bf16 with --device cuda, f32 with cpu; "
                    "fp8: scaled e4m3 rows, half of bf16's bytes; CPU decode nodes "
                    "read them, CUDA ones get --gpu-row-format fp8)",
                    &Config::store_dtype, {"f32", "bf16", "fp8"},
                    /*allow_empty=*/true),
                BoolSetting<Config>("insecure",
                                    "plaintext gRPC and HTTP (default: a CA made for this run in "
                                    "<log dir>/tls, mutual TLS between the processes, TLS on the "
                                    "controller's public gRPC port and HTTPS on its OpenAI API)",
                                    &Config::insecure),
                BoolSetting<Config>("detach",
                                    "return once the cluster is up; it runs on in a background "
                                    "process",
                                    &Config::detach),
                StringSetting<Config>("pid_file",
                                      "write the pid of the process that owns the cluster (SIGTERM "
                                      "it to stop)",
                                      &Config::pid_file, /*allow_empty=*/true),
            },
    };
  }();
  return *table;
}

void AddUpCommand(CLI::App& app) {
  auto line = std::make_shared<node::CommandLine>();
  CLI::App* cmd = app.add_subcommand(
      "up", "start a local cluster (controller, store, prefill and decode nodes) on this machine");
  node::AddSettingOptions(cmd, UpSettings(), line.get());
  cmd->callback([line] {
    absl::StatusOr<node::ResolvedConfig<UpOptions>> resolved =
        node::Resolve(UpSettings(), line->flags, line->config_file, node::NoEnvironment());
    if (!resolved.ok()) {
      std::cerr << "kvr up: " << resolved.status().message() << "\n";
      throw CLI::RuntimeError(2);
    }
    if (line->print_config) {
      std::cout << "# kvr up effective config\n"
                << node::FormatConfig(UpSettings(), *resolved) << std::flush;
      return;
    }
    const UpOptions* o = &resolved->config;
    int ready_fd = -1;
    if (o->detach) {
      // Close-on-exec, so that the nodes do not hold the write end: the foreground part reads
      // until EOF.
      int fds[2];
      if (pipe2(fds, O_CLOEXEC) != 0) throw CLI::RuntimeError(1);
      const pid_t pid = fork();
      if (pid > 0) {
        // The foreground part: wait for the report (or EOF when start-up failed).
        close(fds[1]);
        std::string report;
        char buf[4096];
        ssize_t n;
        while ((n = read(fds[0], buf, sizeof(buf))) > 0) report.append(buf, n);
        if (report.empty()) {
          std::cerr << "kvr up: the cluster did not start\n";
          throw CLI::RuntimeError(1);
        }
        std::cout << report << std::flush;
        return;
      }
      close(fds[0]);
      setsid();
      ready_fd = fds[1];
      // Detached: keep stdout for the log of kvr up itself out of the caller's pipe.
      const int null = open("/dev/null", O_WRONLY);
      if (null >= 0) dup2(null, STDOUT_FILENO);
    }
    if (!o->pid_file.empty()) std::ofstream(o->pid_file) << getpid() << "\n";
    const absl::Status status = RunUp(*o, ready_fd);
    if (!o->pid_file.empty()) std::filesystem::remove(o->pid_file);
    ExitIfError("up", status);
  });
}

}  // namespace kvr::tools
