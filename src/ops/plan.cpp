// weft::describe(Plan): the one-line form of a plan for logs and benchmarks.
#include <sstream>

#include "weft/ops/plan.hpp"

namespace weft {

namespace {
std::string bytes_text(uint64_t b) {
  std::ostringstream s;
  if (b >= (1ull << 20) && b % (1ull << 20) == 0)
    s << (b >> 20) << " MiB";
  else if (b >= (1ull << 10) && b % (1ull << 10) == 0)
    s << (b >> 10) << " KiB";
  else
    s << b << " bytes";
  return s.str();
}
}  // namespace

std::string describe(const Plan& p) {
  std::ostringstream s;
  s << p.op << ": " << (p.path.empty() ? "nothing to do" : p.path);
  if (p.blocks > 0) {
    s << ", " << p.blocks << " blocks";
    if (p.comm_blocks > 0) s << " (" << p.comm_blocks << " communicating)";
    if (p.cluster > 1) s << " in clusters of " << p.cluster;
  }
  if (p.tiles.count > 0)
    s << ", " << p.tiles.count << " tiles of " << p.tiles.m << "x" << p.tiles.n << " (k " << p.tiles.k << ", "
      << p.tiles.stages << " stages)";
  if (p.smem_bytes > 0) s << ", " << p.smem_bytes / 1024 << " KiB smem";
  if (p.chunks > 0) s << ", " << p.chunks << " chunks of " << p.chunk_rows << " rows per shard";
  for (const auto& [area, bytes] : p.workspace)
    if (bytes > 0) s << ", workspace" << (area.empty() ? "" : " '" + area + "'") << " " << bytes_text(bytes);
  if (!p.why_not.empty()) s << " (first choice not taken: " << p.why_not << ")";
  return s.str();
}

}  // namespace weft
