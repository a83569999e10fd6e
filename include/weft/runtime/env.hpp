// How this process was launched: single-process (no launcher variables) or one rank per process from
// torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), mpirun (OMPI_COMM_WORLD_*) or weft-launch
// (the torchrun names plus WEFT_JOB_ID).
#pragma once
#include <functional>
#include <optional>
#include <string>

namespace weft {

enum class Launcher { kNone, kTorchrun, kMpi, kWeft };
const char* launcher_name(Launcher l);

struct LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  int local_world = 1;
  // Nodes: the launcher's (ranks in contiguous blocks of local_world per host, as torchrun and mpirun's
  // default mapping place them), or fake ones splitting one host for tests (WEFT_NODE_SIZE=k: k ranks each).
  // node_size ranks per node; this rank is the (rank % node_size)-th of node `node` (local_rank stays the
  // rank on its host: it picks the GPU). Checked per rank only: a job whose hosts hold different rank counts
  // must be caught at the rendezvous (teams spanning nodes are not built yet).
  int node = 0;
  int nodes = 1;
  int node_size = 1;
  // Names this job's rendezvous socket. Two jobs on one node get different ids: WEFT_JOB_ID if set, else
  // the launcher's own job id (TORCHELASTIC_RUN_ID + MASTER_PORT, the Open MPI/PMIx job id), else the
  // parent process id (torchrun and mpirun start a node's ranks from one parent).
  std::string job_id;
  // WEFT_JOB_SECRET (weft-launch makes one per launch; under torchrun or mpirun set it yourself, e.g.
  // WEFT_JOB_SECRET=$(openssl rand -hex 16)): only a process that knows it can join the rendezvous, whose
  // socket name it also decides (Channel). Empty: the rendezvous checks the peers' uid only.
  std::string secret;
};

using EnvGetter = std::function<std::optional<std::string>(const std::string&)>;
EnvGetter process_env();

// Returns nullopt when no launcher variables are present (single-process mode). Throws weft::Error with a
// precise message for incomplete, malformed or inconsistent environments. Teams spanning nodes parse (the
// communicator refuses them: not built yet).
std::optional<LaunchEnv> parse_launch_env(const EnvGetter& env, long parent_pid);

// Parses a decimal integer in [lo, hi]; throws naming `what` otherwise.
int parse_int(const std::string& text, const std::string& what, int lo, int hi);

}  // namespace weft
