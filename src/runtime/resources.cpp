#include "weft/runtime/resources.hpp"

#include "weft/runtime/error.hpp"

namespace weft {

namespace {
std::vector<ResourceRequest>& declarations() {
  static std::vector<ResourceRequest> all;  // made on first use: declarations run during static init
  return all;
}

std::string counts(const ResourceRequest& r) {
  return std::to_string(r.flags) + " flags, " + std::to_string(r.barrier_slots) + " barrier slots";
}
std::string counts(const ResourceGrant& g) {
  return std::to_string(g.flags.count) + " flags, " + std::to_string(g.slots.count) + " barrier slots";
}
}  // namespace

const std::vector<ResourceRequest>& declared_resources() {
  return declarations();
}

ResourceDeclaration::ResourceDeclaration(ResourceRequest r) {
  declarations().push_back(std::move(r));
}

const ResourceGrant& ResourceRegistry::grant(const ResourceRequest& r) {
  std::lock_guard<std::mutex> lock(mu_);
  WEFT_CHECK(!r.owner.empty() && r.flags >= 0 && r.barrier_slots >= 0,
             "weft resources: a request needs an owner name and counts >= 0 (got '" + r.owner + "', " +
                 counts(r) + ")");
  for (const ResourceGrant& g : grants_)
    if (g.owner == r.owner) {
      WEFT_CHECK(g.flags.count == r.flags && g.slots.count == r.barrier_slots,
                 "weft resources: '" + r.owner + "' was granted " + counts(g) + " and is now asked for " +
                     counts(r) + ": two users of one name must ask for the same");
      return g;
    }
  WEFT_CHECK(next_flag_ + r.flags <= flag_words_ && next_slot_ + r.barrier_slots <= slots_,
             "weft resources: no room for '" + r.owner + "' (" + counts(r) +
                 "): " + std::to_string(flag_words_ - next_flag_) + " flags and " +
                 std::to_string(slots_ - next_slot_) + " barrier slots are left of " +
                 std::to_string(flag_words_) + " and " + std::to_string(slots_));
  ResourceGrant g{r.owner, Flags{next_flag_, r.flags}, BarrierSlots{next_slot_, r.barrier_slots}};
  next_flag_ += r.flags;
  next_slot_ += r.barrier_slots;
  return grants_.emplace_back(std::move(g));
}

const ResourceGrant* ResourceRegistry::find(const std::string& owner) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const ResourceGrant& g : grants_)
    if (g.owner == owner) return &g;
  return nullptr;
}

// Names index i of the runs that `run` picks from each grant ("flag 3 of 'x'"), or says none holds it.
template <class Run>
std::string describe(const std::deque<ResourceGrant>& grants, Run run, int i, const char* what,
                     const char* raw) {
  for (const ResourceGrant& g : grants) {
    const auto r = run(g);
    if (i >= r.first && i < r.first + r.count)
      return std::string(what) + " " + std::to_string(i - r.first) + " of '" + g.owner + "'";
  }
  return std::string(raw) + " " + std::to_string(i) + " (not granted)";
}

std::string ResourceRegistry::describe_flag(int word) const {
  std::lock_guard<std::mutex> lock(mu_);
  return describe(
      grants_, [](const ResourceGrant& g) { return g.flags; }, word, "flag", "flag word");
}

std::string ResourceRegistry::describe_slot(int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return describe(
      grants_, [](const ResourceGrant& g) { return g.slots; }, slot, "barrier slot", "barrier slot");
}

}  // namespace weft
