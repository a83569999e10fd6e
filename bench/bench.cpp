#include "bench.hpp"

#include <cstdarg>
#include <cstring>

namespace weft::bench {

std::vector<Mode>& modes() {
  static std::vector<Mode> m;
  return m;
}

BenchTeam::BenchTeam(const Context& ctx) {
  Options o;
  for (int d = 0; d < ctx.gpus; ++d) o.devices.push_back(d);
  if (ctx.virtual_ranks()) o.ranks_per_gpu = ctx.ranks / ctx.gpus;
  comm = ctx.env ? Communicator::create_from_launcher(*ctx.env, o) : Communicator::create_single_process(o);
  const int L = comm->num_local();
  if (!ctx.virtual_ranks()) nccl.resize(L);
  if (ctx.virtual_ranks()) {
  } else if (ctx.env) {  // one rank per process: rank 0's unique id reaches the others through weft's channel
    ncclUniqueId id{};
    if (comm->local(0).rank() == 0) WEFT_NCCL_CHECK(ncclGetUniqueId(&id));
    const std::string root =
        comm->host_allgather(std::string(reinterpret_cast<const char*>(&id), sizeof(id)))[0];
    std::memcpy(&id, root.data(), sizeof(id));
    WEFT_CUDA_CHECK(cudaSetDevice(comm->local(0).device()));
    WEFT_NCCL_CHECK(ncclCommInitRank(&nccl[0], comm->world(), id, comm->local(0).rank()));
  } else {
    WEFT_NCCL_CHECK(ncclCommInitAll(nccl.data(), comm->world(), o.devices.data()));
  }
  streams.resize(L);
  for (int i = 0; i < L; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(comm->local(i).device()));
    WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
  }
}

BenchTeam::~BenchTeam() {
  for (int i = 0; i < static_cast<int>(streams.size()); ++i) {
    cudaSetDevice(comm->local(i).device());
    cudaStreamDestroy(streams[i]);
    if (has_nccl()) ncclCommDestroy(nccl[i]);
  }
}

double BenchTeam::team_max(double x) {
  double m = x;
  for (const std::string& v :
       comm->host_allgather(std::string(reinterpret_cast<const char*>(&x), sizeof(x)))) {
    double y;
    std::memcpy(&y, v.data(), sizeof(y));
    m = std::max(m, y);
  }
  return m;
}

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return buf;
}

std::string human_bytes(uint64_t b) {
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) return fmt("%llu GiB", (unsigned long long)(b >> 30));
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) return fmt("%llu MiB", (unsigned long long)(b >> 20));
  if (b >= (1ull << 10) && b % (1ull << 10) == 0) return fmt("%llu KiB", (unsigned long long)(b >> 10));
  return fmt("%llu B", (unsigned long long)b);
}

float median(std::vector<float> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Context::progress(const char* f, ...) const {
  if (quiet) return;
  va_list ap;
  va_start(ap, f);
  std::fprintf(stderr, "[weft-bench] ");
  std::vfprintf(stderr, f, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
}

void Context::add(Table t) {
  if (virtual_ranks()) t.prefix_note("Virtual ranks (" + team_label() + "): not a performance figure.");
  if (!json && !quiet) t.print(stdout);
  tables.push_back(std::move(t));
}

std::string Context::team_label() const {
  if (env) return fmt("%d GPUs (one process per GPU)", gpus);
  if (virtual_ranks())
    return fmt("%d virtual ranks on %d GPU%s (single-process)", ranks, gpus, gpus > 1 ? "s" : "");
  return fmt("%d GPUs (single-process)", gpus);
}

void Table::print(std::FILE* out) const {
  std::vector<size_t> w(columns_.size());
  for (size_t c = 0; c < columns_.size(); ++c) {
    w[c] = columns_[c].size();
    for (auto& r : rows_)
      if (c < r.size()) w[c] = std::max(w[c], r[c].size());
  }
  std::fprintf(out, "\n## %s\n", title_.c_str());
  if (!note_.empty()) std::fprintf(out, "%s\n", note_.c_str());
  auto line = [&](const std::vector<std::string>& cells) {
    std::fprintf(out, "|");
    for (size_t c = 0; c < columns_.size(); ++c)
      std::fprintf(out, " %*s |", static_cast<int>(w[c]), c < cells.size() ? cells[c].c_str() : "");
    std::fprintf(out, "\n");
  };
  line(columns_);
  std::fprintf(out, "|");
  for (size_t c = 0; c < columns_.size(); ++c) std::fprintf(out, "%s|", std::string(w[c] + 2, '-').c_str());
  std::fprintf(out, "\n");
  for (auto& r : rows_) line(r);
  std::fflush(out);
}

namespace {
std::string quote(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}
}  // namespace

std::string Table::json() const {
  std::string o = "{\"title\": " + quote(title_) + ", \"note\": " + quote(note_) + ", \"columns\": [";
  for (size_t c = 0; c < columns_.size(); ++c) o += (c ? ", " : "") + quote(columns_[c]);
  o += "], \"rows\": [";
  for (size_t r = 0; r < rows_.size(); ++r) {
    o += r ? ", [" : "[";
    for (size_t c = 0; c < rows_[r].size(); ++c) o += (c ? ", " : "") + quote(rows_[r][c]);
    o += "]";
  }
  return o + "]}";
}

// One graph per local stream of what `enqueue` puts on the streams, captured together (team ops meet across
// the ranks while they are enqueued).
std::vector<cudaGraphExec_t> capture_graphs(Communicator& comm, const std::vector<cudaStream_t>& streams,
                                            const std::function<void()>& enqueue) {
  const int W = comm.num_local();
  std::vector<cudaGraphExec_t> exec(W);
  for (int i = 0; i < W; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
    WEFT_CUDA_CHECK(cudaStreamBeginCapture(streams[i], cudaStreamCaptureModeRelaxed));
  }
  enqueue();
  for (int i = 0; i < W; ++i) {
    cudaGraph_t g;
    WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
    WEFT_CUDA_CHECK(cudaStreamEndCapture(streams[i], &g));
    WEFT_CUDA_CHECK(cudaGraphInstantiate(&exec[i], g, 0));
    WEFT_CUDA_CHECK(cudaGraphDestroy(g));
  }
  return exec;
}

namespace {

// Runs the candidates in turn, `reps` rounds after a warm-up round, each round starting one candidate later
// (no fixed place in it): launch(c, i) enqueues candidate c on local stream i, whose work then ends at event
// done(c, i); after it, record(c, i) reads the times.
void replay_in_turn(Communicator& comm, int candidates, int reps, const std::function<void(int, int)>& launch,
                    const std::function<cudaEvent_t(int, int)>& done,
                    const std::function<void(int, int)>& record) {
  const int W = comm.num_local();
  for (int rep = -1; rep < reps; ++rep)
    for (int turn = 0; turn < candidates; ++turn) {
      const int c = (turn + rep + 1) % candidates;
      for (int i = 0; i < W; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
        launch(c, i);
      }
      for (int i = 0; i < W; ++i) {
        WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
        WEFT_CUDA_CHECK(cudaEventSynchronize(done(c, i)));
        if (rep >= 0) record(c, i);
      }
    }
  comm.check_device_errors();
}

}  // namespace

// Captures `iters` calls per GPU (rotating buffer sets) of each candidate into one graph per GPU, replays
// the candidates' graphs in turn `reps` times (after a warm-up round), and returns per candidate the slowest
// rank's median time per call in microseconds. Taking turns keeps slow drift of the machine (clocks, heat)
// out of the candidates' ratios; rotating who goes first keeps out what one candidate leaves the next (a
// hot GPU after a long one).
std::vector<double> time_graphs_alternating(Communicator& comm, const std::vector<cudaStream_t>& streams,
                                            int iters, int reps,
                                            const std::vector<std::function<void(int)>>& candidates) {
  const int W = comm.num_local(), C = static_cast<int>(candidates.size());
  std::vector<std::vector<cudaGraphExec_t>> exec(C);
  for (int c = 0; c < C; ++c)
    exec[c] = capture_graphs(comm, streams, [&] {
      for (int k = 0; k < iters; ++k) candidates[c](k);
    });
  std::vector<cudaEvent_t> start(W), stop(W);
  for (int i = 0; i < W; ++i) {
    WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
    WEFT_CUDA_CHECK(cudaEventCreate(&start[i]));
    WEFT_CUDA_CHECK(cudaEventCreate(&stop[i]));
  }
  // The events go around each launch (on the streams, not in the graphs: the launch counts).
  std::vector<std::vector<std::vector<float>>> ms(C, std::vector<std::vector<float>>(W));
  replay_in_turn(
      comm, C, reps,
      [&](int c, int i) {
        WEFT_CUDA_CHECK(cudaEventRecord(start[i], streams[i]));
        WEFT_CUDA_CHECK(cudaGraphLaunch(exec[c][i], streams[i]));
        WEFT_CUDA_CHECK(cudaEventRecord(stop[i], streams[i]));
      },
      [&](int, int i) { return stop[i]; },
      [&](int c, int i) {
        float t = 0;
        WEFT_CUDA_CHECK(cudaEventElapsedTime(&t, start[i], stop[i]));
        ms[c][i].push_back(t);
      });
  std::vector<double> worst(C, 0.0);
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < W; ++i) {
      worst[c] = std::max(worst[c], double(median(ms[c][i])) * 1000.0 / iters);
      cudaGraphExecDestroy(exec[c][i]);
    }
  for (int i = 0; i < W; ++i) {
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  return worst;
}

std::vector<std::vector<double>> time_phases_alternating(
    Communicator& comm, const std::vector<cudaStream_t>& streams, int phases, int reps,
    const std::vector<std::function<void(int)>>& candidates) {
  const int W = comm.num_local(), C = static_cast<int>(candidates.size());
  // marks[c][i][p]: on stream i, before phase p of candidate c (p = phases: after the last), as graph nodes.
  std::vector<std::vector<std::vector<cudaEvent_t>>> marks(
      C, std::vector<std::vector<cudaEvent_t>>(W, std::vector<cudaEvent_t>(phases + 1)));
  const auto mark = [&](int c, int p) {
    for (int i = 0; i < W; ++i) {
      WEFT_CUDA_CHECK(cudaSetDevice(comm.local(i).device()));
      WEFT_CUDA_CHECK(cudaEventCreate(&marks[c][i][p]));
      WEFT_CUDA_CHECK(cudaEventRecordWithFlags(marks[c][i][p], streams[i], cudaEventRecordExternal));
    }
  };
  std::vector<std::vector<cudaGraphExec_t>> exec(C);
  for (int c = 0; c < C; ++c)
    exec[c] = capture_graphs(comm, streams, [&] {
      comm.device_barrier(streams);  // the ranks start the first phase together (see the header)
      mark(c, 0);
      for (int p = 0; p < phases; ++p) {
        candidates[c](p);
        mark(c, p + 1);
      }
    });
  // ms[c][i][p]: phase p's times on stream i (p = phases: the whole call).
  std::vector<std::vector<std::vector<std::vector<float>>>> ms(
      C, std::vector<std::vector<std::vector<float>>>(W, std::vector<std::vector<float>>(phases + 1)));
  replay_in_turn(
      comm, C, reps, [&](int c, int i) { WEFT_CUDA_CHECK(cudaGraphLaunch(exec[c][i], streams[i])); },
      [&](int c, int i) { return marks[c][i][phases]; },
      [&](int c, int i) {
        for (int p = 0; p <= phases; ++p) {
          float t = 0;
          const int from = p < phases ? p : 0, to = p < phases ? p + 1 : phases;
          WEFT_CUDA_CHECK(cudaEventElapsedTime(&t, marks[c][i][from], marks[c][i][to]));
          ms[c][i][p].push_back(t);
        }
      });
  std::vector<std::vector<double>> worst(C, std::vector<double>(phases + 1, 0.0));
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < W; ++i) {
      for (int p = 0; p <= phases; ++p)
        worst[c][p] = std::max(worst[c][p], double(median(ms[c][i][p])) * 1000.0);
      cudaGraphExecDestroy(exec[c][i]);
      for (cudaEvent_t e : marks[c][i]) cudaEventDestroy(e);
    }
  return worst;
}

double time_graphs(Communicator& comm, const std::vector<cudaStream_t>& streams, int iters, int reps,
                   const std::function<void(int)>& enqueue) {
  return time_graphs_alternating(comm, streams, iters, reps, {enqueue})[0];
}

float median_call_ms(const std::function<void()>& call, int iters, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) call();
  std::vector<cudaEvent_t> ev(iters + 1);
  for (auto& e : ev) WEFT_CUDA_CHECK(cudaEventCreate(&e));
  WEFT_CUDA_CHECK(cudaEventRecord(ev[0], stream));
  for (int i = 0; i < iters; ++i) {
    call();
    WEFT_CUDA_CHECK(cudaEventRecord(ev[i + 1], stream));
  }
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  return median(ms);
}

std::vector<float> time_in_turns(const std::vector<std::function<void(int)>>& candidates, int iters,
                                 cudaStream_t stream) {
  const size_t n = candidates.size();
  for (int i = 0; i < 3; ++i)
    for (auto& c : candidates) c(i);
  std::vector<cudaEvent_t> ev(iters * (n + 1));
  for (auto& e : ev) WEFT_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    WEFT_CUDA_CHECK(cudaEventRecord(ev[i * (n + 1)], stream));
    for (size_t c = 0; c < n; ++c) {
      candidates[c](i);
      WEFT_CUDA_CHECK(cudaEventRecord(ev[i * (n + 1) + c + 1], stream));
    }
  }
  WEFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> medians;
  for (size_t c = 0; c < n; ++c) {
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
      float ms = 0;
      WEFT_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i * (n + 1) + c], ev[i * (n + 1) + c + 1]));
      t.push_back(ms);
    }
    medians.push_back(median(t));
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return medians;
}

}  // namespace weft::bench
