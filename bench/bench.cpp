#include "bench.hpp"

#include <cstdarg>
#include <cstring>

namespace weft::bench {

std::vector<Mode>& modes() {
  static std::vector<Mode> m;
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
  if (!json && !quiet) t.print(stdout);
  tables.push_back(std::move(t));
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

}  // namespace weft::bench
