#include "weft/runtime/env.hpp"

#include <cerrno>
#include <cstdlib>
#include <vector>

#include "weft/runtime/error.hpp"
#include "weft/team_view.hpp"

namespace weft {

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::kNone:
      return "single-process";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kMpi:
      return "mpirun";
    case Launcher::kWeft:
      return "weft-launch";
  }
  return "?";
}

EnvGetter process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

int parse_int(const std::string& text, const std::string& what, int lo, int hi) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end == text.c_str() || *end != '\0' || errno == ERANGE || v < lo || v > hi)
    throw_error("weft: " + what + "='" + text + "' is not an integer in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  return static_cast<int>(v);
}

namespace {

struct VarSet {
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
};

constexpr VarSet kTorchVars{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr VarSet kOmpiVars{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                           "OMPI_COMM_WORLD_LOCAL_SIZE"};

bool any_present(const EnvGetter& env, const VarSet& s) {
  return env(s.rank) || env(s.world) || env(s.local_rank) || env(s.local_world);
}

LaunchEnv read_vars(const EnvGetter& env, const VarSet& s, Launcher launcher) {
  std::vector<std::string> missing;
  for (const char* name : {s.rank, s.world, s.local_rank, s.local_world})
    if (!env(name)) missing.push_back(name);
  if (!missing.empty()) {
    std::string list;
    for (auto& m : missing) list += (list.empty() ? "" : ", ") + m;
    throw_error(std::string("weft: incomplete ") + launcher_name(launcher) + " environment: " + list +
                " not set (a rank needs " + s.rank + ", " + s.world + ", " + s.local_rank + " and " +
                s.local_world + ")");
  }
  LaunchEnv e;
  e.launcher = launcher;
  // A job spanning nodes may hold more ranks than one team (kMaxWorld bounds the ranks of a node).
  constexpr int kMaxJobWorld = 1 << 16;
  e.world = parse_int(*env(s.world), s.world, 1, kMaxJobWorld);
  e.rank = parse_int(*env(s.rank), s.rank, 0, e.world - 1);
  e.local_world = parse_int(*env(s.local_world), s.local_world, 1, kMaxWorld);
  e.local_rank = parse_int(*env(s.local_rank), s.local_rank, 0, e.local_world - 1);
  // Several hosts: the same number of ranks on each, in contiguous blocks (rank = node x local_world +
  // local_rank).
  if (e.world % e.local_world != 0)
    throw_error("weft: " + std::string(s.world) + "=" + std::to_string(e.world) + " is not a multiple of " +
                s.local_world + "=" + std::to_string(e.local_world) +
                ": a multi-node job needs the same number of ranks on every node");
  if (e.local_rank != e.rank % e.local_world)
    throw_error("weft: " + std::string(s.rank) + "=" + std::to_string(e.rank) + " and " + s.local_rank + "=" +
                std::to_string(e.local_rank) + " do not place ranks in contiguous blocks of " +
                s.local_world + "=" + std::to_string(e.local_world) + " per node (" +
                (e.world == e.local_world ? "on a single-node job they must agree)"
                                          : "multi-node: rank = node x local_world + local_rank)"));
  e.node_size = e.local_world;
  if (auto k = env("WEFT_NODE_SIZE"); k && !k->empty()) {  // fake nodes on one host (tests)
    e.node_size = parse_int(*k, "WEFT_NODE_SIZE", 1, e.local_world);
    if (e.local_world % e.node_size != 0)
      throw_error("weft: WEFT_NODE_SIZE=" + *k + " does not divide the " + std::to_string(e.local_world) +
                  " ranks of a node");
  }
  e.node = e.rank / e.node_size;
  e.nodes = e.world / e.node_size;
  return e;
}

}  // namespace

std::optional<LaunchEnv> parse_launch_env(const EnvGetter& env, long parent_pid) {
  std::optional<LaunchEnv> e;
  if (any_present(env, kTorchVars)) {
    e = read_vars(env, kTorchVars, env("WEFT_JOB_ID") ? Launcher::kWeft : Launcher::kTorchrun);
  } else if (any_present(env, kOmpiVars)) {
    e = read_vars(env, kOmpiVars, Launcher::kMpi);
  } else {
    return std::nullopt;
  }
  if (auto id = env("WEFT_JOB_ID"); id && !id->empty()) {
    e->job_id = *id;
  } else if (auto run = env("TORCHELASTIC_RUN_ID"); run && e->launcher == Launcher::kTorchrun) {
    e->job_id = "te-" + *run + "-" + env("MASTER_PORT").value_or("0") + "-" +
                env("TORCHELASTIC_RESTART_COUNT").value_or("0");
  } else if (auto ns = env("PMIX_NAMESPACE"); ns && e->launcher == Launcher::kMpi) {
    e->job_id = "pmix-" + *ns;
  } else if (auto jid = env("OMPI_MCA_ess_base_jobid"); jid && e->launcher == Launcher::kMpi) {
    e->job_id = "ompi-" + *jid;
  } else {
    e->job_id = "ppid-" + std::to_string(parent_pid);
  }
  for (char& c : e->job_id)
    if (c == '/' || c == '\0' || c == ' ') c = '_';
  if (e->job_id.size() > 64) e->job_id = e->job_id.substr(e->job_id.size() - 64);
  if (auto secret = env("WEFT_JOB_SECRET"); secret && !secret->empty()) {
    WEFT_CHECK(secret->size() >= 16,
               "weft: WEFT_JOB_SECRET must hold at least 16 characters (e.g. "
               "$(openssl rand -hex 16)), got " +
                   std::to_string(secret->size()));
    e->secret = *secret;
  }
  return e;
}

}  // namespace weft
