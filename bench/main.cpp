// weft-bench: the main job. With no arguments it runs every mode, single-process over all local GPUs.
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <ctime>
#include <numeric>

#include <unistd.h>

#include "bench.hpp"

using namespace weft::bench;

namespace {
int usage(int code) {
  std::fprintf(
      code ? stderr : stdout,
      "usage: weft-bench [MODE ...] [--json] [--gpus N] [--ranks W] [--quick] [--list]\n"
      "  Runs the chosen modes (default: all) single-process over the first N local GPUs (default: all).\n"
      "  --ranks W: a team of W virtual ranks over the GPUs (W / N per GPU; default N: the largest that\n"
      "           divides W), for the modes that take them; no NCCL baseline, not a performance figure\n"
      "  --json   machine-readable output on stdout (progress stays on stderr)\n"
      "  --quick  fewer sizes and iterations\n"
      "developer flags (tuning):\n"
      "  --ar-algo oneshot|twoshot   force weft's all-reduce algorithm\n"
      "  --flow pull|steps|push      force the reduce-scatter / two-shot reduce flow\n"
      "  --min-bytes B --max-bytes B collective sizes kept\n"
      "  --fused-m M1,M2,..          the fused modes' M values\n"
      "  --gemm-shapes MxNxK,..      gemm: only these shapes, each with the grouped order's band heights\n"
      "  --fused-ops ag,rs,ar        the fused ops run\n"
      "  --fused-progressive         fused: also time FusedOptions::Partials::kStagedProgressive (RS / AR)\n"
      "  --decode-grid               flash_decode: the one-GPU kernel over batch 1..64 x 8k..128k tokens\n"
      "                              x heads 64/8 and 32/8 instead of the cases (no team rows)\n"
      "  --fused-epilogue-sum        fused: also time FusedOptions::Partials::kSummedInEpilogue (RS / AR)\n"
      "  --pipeline-pieces n         FusedOptions::pipeline_pieces of the weft and pipelined columns\n"
      "  --ag-comm-blocks n          FusedOptions::comm_blocks (all_gather_matmul's communicator blocks, "
      "and\n"
      "                              the counted RS / AR's: added at owner, staged progressive)\n"
      "  --ag-tile-n 128|256         FusedOptions::tile_n (all_gather_matmul's fused tiles; default auto)\n"
      "  --rs-store-ring 2|5         FusedOptions::store_ring (the fused RS / AR storers' ring of chunks)\n"
      "  --timeline DIR              fused / decode / moe / flash_decode / attention / context_attention: "
      "also "
      "record one call "
      "of each\n"
      "                              row's weft paths with in-kernel timestamps: DIR/<op>_<shape>.csv and a\n"
      "                              summary table per call (scripts/plot_timeline.py draws the CSV)\n"
      "  --cp-methods all-gather,ring,ulysses,hybrid  the context_attention methods run (ring-no-copy: the "
      "ring\n"
      "                                         kernels with no data movement, timing only)\n"
      "  --cp-seqs S,...             context_attention: these sequence lengths (the whole team's tokens)\n"
      "  --cp-heads H,KV             context_attention: H query heads, KV K / V heads (default 16,8)\n"
      "modes:\n");
  for (auto& m : modes())
    std::fprintf(code ? stderr : stdout, "  %-10s %s%s\n", m.name, m.help,
                 m.by_default ? "" : " (run by name only: not yet in the default run)");
  return code;
}
// A positive integer (decimal or 0x hex) filling all of `v`.
bool parse_count(const std::string& v, uint64_t& out) {
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 0);
  if (v.empty() || v[0] == '-' || *end != '\0' || x == 0) return false;
  out = x;
  return true;
}

bool set_developer_flag(Context& ctx, const std::string& flag, const std::string& v) {
  uint64_t n = 0;
  if (flag == "--ar-algo") return (v == "oneshot" || v == "twoshot") && (ctx.ar_algo = v, true);
  if (flag == "--flow") return (v == "pull" || v == "steps" || v == "push") && (ctx.flow = v, true);
  if (flag == "--fused-ops") {
    for (size_t p = 0; p <= v.size();) {
      const size_t e = std::min(v.find(',', p), v.size());
      const std::string op = v.substr(p, e - p);
      if (op != "ag" && op != "rs" && op != "ar") return false;
      p = e + 1;
    }
    ctx.fused_ops = v;
    return true;
  }
  if (flag == "--cp-methods") {
    for (size_t p = 0; p <= v.size();) {
      const size_t e = std::min(v.find(',', p), v.size());
      const std::string m = v.substr(p, e - p);
      if (m != "all-gather" && m != "ring" && m != "ring-no-copy" && m != "ulysses" && m != "hybrid")
        return false;
      p = e + 1;
    }
    ctx.cp_methods = v;
    return true;
  }
  if (flag == "--timeline") return !v.empty() && (ctx.timeline_dir = v, true);
  if (flag == "--cp-seqs" || flag == "--cp-heads") {
    std::vector<int64_t> xs;
    for (size_t p = 0; p <= v.size();) {
      const size_t e = std::min(v.find(',', p), v.size());
      if (!parse_count(v.substr(p, e - p), n)) return false;
      xs.push_back(int64_t(n));
      p = e + 1;
    }
    if (flag == "--cp-seqs") return ctx.cp_seqs = xs, true;
    if (xs.size() != 2 || xs[0] % xs[1] != 0) return false;  // whole GQA groups
    ctx.cp_heads = static_cast<int>(xs[0]);
    ctx.cp_kv_heads = static_cast<int>(xs[1]);
    return true;
  }
  if (flag == "--fused-m") {
    ctx.fused_m.clear();
    for (size_t p = 0; p <= v.size();) {
      const size_t e = std::min(v.find(',', p), v.size());
      if (!parse_count(v.substr(p, e - p), n)) return false;
      ctx.fused_m.push_back(int64_t(n));
      p = e + 1;
    }
    return true;
  }
  if (flag == "--gemm-shapes") {
    ctx.gemm_shapes.clear();
    for (size_t p = 0; p <= v.size();) {
      const size_t e = std::min(v.find(',', p), v.size());
      const std::string shape = v.substr(p, e - p);
      for (size_t q = 0; q <= shape.size();) {
        const size_t f = std::min(shape.find('x', q), shape.size());
        if (!parse_count(shape.substr(q, f - q), n)) return false;
        ctx.gemm_shapes.push_back(int64_t(n));
        q = f + 1;
      }
      p = e + 1;
    }
    return ctx.gemm_shapes.size() % 3 == 0;
  }
  if (!parse_count(v, n)) return false;
  if (flag == "--min-bytes") ctx.min_bytes = n;
  if (flag == "--max-bytes") ctx.max_bytes = n;
  if (flag == "--pipeline-pieces") ctx.pipeline_pieces = static_cast<int>(n);
  if (flag == "--ag-comm-blocks") ctx.ag_comm_blocks = static_cast<int>(n);
  if (flag == "--ag-tile-n") return (n == 128 || n == 256) && (ctx.ag_tile_n = static_cast<int>(n), true);
  if (flag == "--rs-store-ring") return (n == 2 || n == 5) && (ctx.rs_store_ring = static_cast<int>(n), true);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Context ctx;
  std::vector<const Mode*> chosen;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json")
      ctx.json = true;
    else if (a == "--quick")
      ctx.quick = true;
    else if (a == "--fused-progressive")
      ctx.fused_progressive = true;
    else if (a == "--decode-grid")
      ctx.decode_grid = true;
    else if (a == "--fused-epilogue-sum")
      ctx.fused_epilogue_sum = true;
    else if ((a == "--gpus" || a == "--ranks") && i + 1 < argc) {
      const int v = std::atoi(argv[++i]);
      if (v < 1) {
        std::fprintf(stderr, "weft-bench: %s takes a positive integer, got '%s'\n", a.c_str(), argv[i]);
        return 2;
      }
      (a == "--gpus" ? ctx.gpus : ctx.ranks) = v;
    } else if (a == "--ar-algo" || a == "--flow" || a == "--fused-ops" || a == "--min-bytes" ||
               a == "--max-bytes" || a == "--fused-m" || a == "--gemm-shapes" || a == "--pipeline-pieces" ||
               a == "--cp-methods" || a == "--cp-seqs" || a == "--cp-heads" || a == "--ag-comm-blocks" ||
               a == "--ag-tile-n" || a == "--rs-store-ring" || a == "--timeline") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "weft-bench: %s takes a value\n", a.c_str());
        return 2;
      }
      const std::string v = argv[++i];
      if (!set_developer_flag(ctx, a, v)) {
        std::fprintf(stderr, "weft-bench: bad value '%s' for %s (weft-bench --help)\n", v.c_str(), a.c_str());
        return 2;
      }
    } else if (a == "--list" || a == "-h" || a == "--help")
      return usage(0);
    else {
      const Mode* m = nullptr;
      for (auto& x : modes())
        if (a == x.name) m = &x;
      if (!m) {
        std::fprintf(stderr, "weft-bench: unknown mode or option '%s'\n", a.c_str());
        return usage(2);
      }
      chosen.push_back(m);
    }
  }
  if (chosen.empty())
    for (auto& m : modes())
      if (m.by_default) chosen.push_back(&m);

  // Virtual ranks need the most hardware work queues (weft::Communicator says why), read when CUDA starts:
  // set before the first CUDA call, and only for them (real GPUs keep the driver's default).
  if (ctx.ranks > 0) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  if (const std::string why = weft::cuda_unavailable_reason(); !why.empty()) {
    std::fprintf(stderr, "weft-bench: %s. weft-bench measures GPUs and needs at least one Hopper GPU.\n",
                 why.c_str());
    return 1;
  }
  int ndev = 0;
  WEFT_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  if (ctx.gpus > ndev) {
    std::fprintf(stderr, "weft-bench: --gpus %d but only %d GPU%s visible\n", ctx.gpus, ndev,
                 ndev > 1 ? "s" : "");
    return 2;
  }
  if (ctx.gpus <= 0) ctx.gpus = ctx.ranks > 0 ? std::gcd(ctx.ranks, ndev) : ndev;
  if (ctx.ranks > 0 && ctx.ranks % ctx.gpus != 0) {
    std::fprintf(stderr, "weft-bench: --ranks %d is not a multiple of the %d GPUs in use\n", ctx.ranks,
                 ctx.gpus);
    return 2;
  }
  try {
    ctx.env = weft::parse_launch_env(weft::process_env(), static_cast<long>(::getppid()));
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "weft-bench: %s\n", ex.what());
    return 2;
  }
  if (ctx.env) {  // one rank per process: rank 0 reports for the team
    if (ctx.ranks > 0) {
      std::fprintf(stderr, "weft-bench: --ranks (virtual ranks) runs single-process, not under a launcher\n");
      return 2;
    }
    ctx.quiet = ctx.env->rank != 0;
    ctx.gpus = ctx.env->world;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::string machine =
      fmt("%d x %s (%d SMs), driver %d.%d, CUDA runtime %d.%d, %s, %s", ctx.gpus, prop.name,
          prop.multiProcessorCount, drv / 1000, (drv % 1000) / 10, rt / 1000, (rt % 1000) / 10,
          ctx.env               ? "one process per GPU"
          : ctx.virtual_ranks() ? fmt("single-process, %d virtual ranks", ctx.ranks).c_str()
                                : "single-process",
          date);
  if (!ctx.json && !ctx.quiet) std::printf("# weft-bench\n%s\n", machine.c_str());

  int rc = 0;
  for (const Mode* m : chosen) {
    if (ctx.virtual_ranks() && !m->virtual_ranks) {  // it builds teams of its own, one rank per GPU
      ctx.progress("mode %s skipped: needs one GPU per rank (no virtual ranks)", m->name);
      if (!ctx.json && !ctx.quiet) std::printf("## %s: SKIPPED (needs one GPU per rank)\n\n", m->name);
      continue;
    }
    if (ctx.team_size() <
        m->min_gpus) {  // e.g. a single-GPU machine: the team modes cannot run, the GEMM can
      ctx.progress("mode %s skipped: needs %d GPUs, %d in use", m->name, m->min_gpus, ctx.gpus);
      if (!ctx.json && !ctx.quiet)
        std::printf("## %s: SKIPPED (needs %d GPUs, %d in use; --ranks W runs it on virtual ranks)\n\n",
                    m->name, m->min_gpus, ctx.gpus);
      continue;
    }
    ctx.progress("mode %s", m->name);
    try {
      m->run(ctx);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "weft-bench: mode %s failed: %s\n", m->name, ex.what());
      rc = 1;
    }
  }
  if (ctx.json && !ctx.quiet) {
    std::printf("{\"machine\": \"%s\", \"tables\": [", machine.c_str());
    for (size_t i = 0; i < ctx.tables.size(); ++i)
      std::printf("%s%s", i ? ",\n" : "\n", ctx.tables[i].json().c_str());
    std::printf("]}\n");
  }
  return rc;
}
