// The resource registry (weft/runtime/resources.hpp): runs granted in order, one grant per name, shared
// names, the errors, and the names that error messages use.
#include <gtest/gtest.h>

#include "weft/runtime/error.hpp"
#include "weft/runtime/resources.hpp"

using weft::ResourceGrant;
using weft::ResourceRegistry;
using weft::ResourceRequest;

TEST(Resources, RunsFollowEachOtherAndNamesAreKept) {
  ResourceRegistry reg(100, 10);
  const ResourceGrant& a = reg.grant({"a", 8, 2});
  const ResourceGrant& b = reg.grant({"b", 3, 0});
  const ResourceGrant& c = reg.grant({"c", 0, 4});
  EXPECT_EQ(a.flags.first, 0);
  EXPECT_EQ(a.flags.count, 8);
  EXPECT_EQ(a.slots.first, 0);
  EXPECT_EQ(a.slots[1], 1);
  EXPECT_EQ(b.flags.first, 8);
  EXPECT_EQ(c.slots.first, 2);
  EXPECT_EQ(c.slots[3], 5);
  EXPECT_EQ(reg.flags_granted(), 11);
  EXPECT_EQ(reg.slots_granted(), 6);
  EXPECT_EQ(reg.describe_flag(9), "flag 1 of 'b'");
  EXPECT_EQ(reg.describe_flag(11), "flag word 11 (not granted)");
  EXPECT_EQ(reg.describe_slot(4), "barrier slot 2 of 'c'");
  EXPECT_EQ(reg.find("b"), &b);
  EXPECT_EQ(reg.find("zzz"), nullptr);
}

TEST(Resources, OneNameOneGrant) {
  ResourceRegistry reg(100, 10);
  const ResourceGrant& a = reg.grant({"shared", 4, 1});
  const ResourceGrant& again = reg.grant({"shared", 4, 1});
  EXPECT_EQ(&a, &again);
  EXPECT_EQ(reg.flags_granted(), 4);
  try {
    reg.grant({"shared", 5, 1});
    FAIL() << "a second request with other counts must be refused";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'shared' was granted 4 flags, 1 barrier slots"), std::string::npos)
        << e.what();
  }
}

TEST(Resources, FullPadAndBadRequestsAreRefused) {
  ResourceRegistry reg(10, 2);
  reg.grant({"a", 8, 1});
  try {
    reg.grant({"b", 3, 0});
    FAIL() << "over capacity";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no room for 'b'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("2 flags and 1 barrier slots are left"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(reg.grant({"", 1, 0}), weft::Error);
  EXPECT_THROW(reg.grant({"neg", -1, 0}), weft::Error);
  EXPECT_EQ(reg.grant({"fits", 2, 1}).flags.first, 8);
}
