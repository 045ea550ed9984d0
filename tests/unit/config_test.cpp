// Tests of the settings table (runtime/config.hpp) and of the log line format (runtime/log.hpp): size parsing
// and its rejections, booleans, log levels, override order, when layerswap is enabled, unknown names and
// their suggestions, describe(), the process environment, format_bytes.
#include "runtime/config.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/error.hpp"
#include "runtime/log.hpp"

namespace layerswap {
namespace {

using vars = std::vector<std::pair<std::string, std::string>>;

constexpr std::uint64_t kib = std::uint64_t{1} << 10;
constexpr std::uint64_t mib = std::uint64_t{1} << 20;
constexpr std::uint64_t gib = std::uint64_t{1} << 30;
constexpr std::uint64_t tib = std::uint64_t{1} << 40;

const setting_info& row(std::string_view name) {
  for (const auto& info : settings_table()) {
    if (name == info.name) return info;
  }
  throw std::logic_error("no row " + std::string(name));
}

std::uint64_t bytes_of(std::string_view value) {
  const auto size = parse_size("LAYERSWAP_BUDGET", value, true);
  EXPECT_EQ(size.how, size_setting::kind::bytes) << value;
  return size.resolve(0);
}

// The config_error message of parse_size(name, value), or "" when it did not throw.
std::string size_error(std::string_view name, std::string_view value, bool allow_percent) {
  try {
    (void)parse_size(name, value, allow_percent);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

std::string config_error_of(const vars& v) {
  try {
    (void)parse_config(v);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

// ---- the table ----

TEST(SettingsTable, HasEveryRowOnceWithHelpAndDefaults) {
  const auto table = settings_table();
  ASSERT_EQ(table.size(), 21u);
  std::vector<std::string> names;
  for (const auto& info : table) {
    names.emplace_back(info.name);
    EXPECT_NE(std::string(info.accepted), "") << info.name;
    EXPECT_NE(std::string(info.help), "") << info.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"LAYERSWAP", "LAYERSWAP_BUDGET", "LAYERSWAP_LOG", "LAYERSWAP_STATS",
                                             "LAYERSWAP_VA_RESERVE", "LAYERSWAP_TRACK", "LAYERSWAP_TRACK_API", "LAYERSWAP_TRACE",
                                             "LAYERSWAP_PREFETCH", "LAYERSWAP_PIN", "LAYERSWAP_HOST_LIMIT", "LAYERSWAP_HOLD",
                                             "LAYERSWAP_WRITEBACK", "LAYERSWAP_OVERSIZE",
                                             "LAYERSWAP_CACHE_RESERVE", "LAYERSWAP_COMPOSITES", "LAYERSWAP_SPLIT",
                                             "LAYERSWAP_SPLIT_FREE", "LAYERSWAP_RECLAIM", "LAYERSWAP_RESERVE", "LAYERSWAP_PROGRAM_FIRST"}));
  EXPECT_STREQ(row("LAYERSWAP").default_value, "0");
  EXPECT_STREQ(row("LAYERSWAP_BUDGET").default_value, "none");
  EXPECT_STREQ(row("LAYERSWAP_LOG").default_value, "warn");
  EXPECT_STREQ(row("LAYERSWAP_STATS").default_value, "0");
  EXPECT_STREQ(row("LAYERSWAP_VA_RESERVE").default_value, "1TiB");
  EXPECT_STREQ(row("LAYERSWAP_TRACK").default_value, "auto");
  EXPECT_STREQ(row("LAYERSWAP_TRACE").default_value, "none");
  // The help says that an explicit 0 wins over a budget.
  EXPECT_NE(std::string(row("LAYERSWAP").help).find("LAYERSWAP=0"), std::string::npos);
}

TEST(SettingsTable, DefaultsParseToTheConfigDefaults) {
  vars defaults;
  for (const auto& info : settings_table()) defaults.emplace_back(info.name, info.default_value);
  const config from_table = parse_config(defaults);
  const config empty = parse_config(vars{});
  EXPECT_EQ(from_table.enabled, empty.enabled);
  EXPECT_EQ(from_table.budget.is_set(), empty.budget.is_set());
  EXPECT_EQ(from_table.log, empty.log);
  EXPECT_EQ(from_table.stats, empty.stats);
  EXPECT_EQ(from_table.va_reserve, empty.va_reserve);
  EXPECT_EQ(empty.va_reserve, tib);
  EXPECT_EQ(from_table.track, empty.track);
  EXPECT_EQ(from_table.trace, empty.trace);
  EXPECT_EQ(from_table.track_api, empty.track_api);
}

// ---- the launch tracker's settings ----

TEST(TrackSetting, AutoFollowsEnabled) {
  EXPECT_EQ(parse_config(vars{}).track, config::track_mode::automatic);
  EXPECT_FALSE(parse_config(vars{}).tracking());
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP", "1"}}).tracking());
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_BUDGET", "6GiB"}, {"LAYERSWAP_TRACK", "auto"}}).tracking());
  EXPECT_FALSE(parse_config(vars{{"LAYERSWAP", "1"}, {"LAYERSWAP_TRACK", "0"}}).tracking());
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_TRACK", "on"}}).tracking());
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_TRACK", " AUTO "}}).track, config::track_mode::automatic);
}

TEST(TrackSetting, BadValueNamesTheAcceptedForms) {
  try {
    (void)parse_config(vars{{"LAYERSWAP_TRACK", "sometimes"}});
    FAIL() << "no error";
  } catch (const config_error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("LAYERSWAP_TRACK=\"sometimes\""), std::string::npos) << message;
    EXPECT_NE(message.find(row("LAYERSWAP_TRACK").accepted), std::string::npos) << message;
  }
}

TEST(TrackSetting, SubscribeOnlyIsAMeasurementMode) {
  const config c = parse_config(vars{{"LAYERSWAP_TRACK", " Subscribe-Only "}});
  EXPECT_EQ(c.track, config::track_mode::subscribe_only);
  EXPECT_TRUE(c.tracking());
  EXPECT_NE(c.describe().find("LAYERSWAP_TRACK=subscribe-only\n"), std::string::npos) << c.describe();
  EXPECT_STREQ(track_name(config::track_mode::off), "0");
  EXPECT_NE(config_error_of(vars{{"LAYERSWAP_TRACK", "subscribe"}}).find(row("LAYERSWAP_TRACK").accepted),
            std::string::npos);
}

TEST(TrackSetting, AttributeIsAMeasurementModeThatTracks) {
  const config c = parse_config(vars{{"LAYERSWAP_TRACK", "Attribute"}});
  EXPECT_EQ(c.track, config::track_mode::attribute);
  EXPECT_TRUE(c.tracking());
  EXPECT_NE(c.describe().find("LAYERSWAP_TRACK=attribute\n"), std::string::npos) << c.describe();
  EXPECT_NE(std::string(row("LAYERSWAP_TRACK").accepted).find("attribute"), std::string::npos);
}

TEST(TrackApiSetting, BothOrDriver) {
  EXPECT_STREQ(row("LAYERSWAP_TRACK_API").default_value, "driver");
  EXPECT_EQ(parse_config(vars{}).track_api, config::track_api_mode::driver);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_TRACK_API", " DRIVER "}}).track_api, config::track_api_mode::driver);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_TRACK_API", "both"}}).track_api, config::track_api_mode::both);
  const config c = parse_config(vars{{"LAYERSWAP_TRACK_API", "both"}});
  EXPECT_NE(c.describe().find("LAYERSWAP_TRACK_API=both\n"), std::string::npos) << c.describe();
  const std::string message = config_error_of(vars{{"LAYERSWAP_TRACK_API", "runtime"}});
  EXPECT_NE(message.find("LAYERSWAP_TRACK_API=\"runtime\""), std::string::npos) << message;
  EXPECT_NE(message.find("driver or both"), std::string::npos) << message;
}

TEST(TraceSetting, PathOrNone) {
  EXPECT_EQ(parse_config(vars{}).trace, "");
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_TRACE", " /tmp/t.json "}}).trace, "/tmp/t.json");
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_TRACE", "none"}}).trace, "");
  const config c = parse_config(vars{{"LAYERSWAP_TRACE", "/tmp/t.json"}, {"LAYERSWAP_TRACK", "1"}});
  EXPECT_NE(c.describe().find("LAYERSWAP_TRACE=/tmp/t.json\n"), std::string::npos);
  EXPECT_NE(c.describe().find("LAYERSWAP_TRACK=1\n"), std::string::npos);
  EXPECT_NE(parse_config(vars{}).describe().find("LAYERSWAP_TRACK=auto  (default)"), std::string::npos);
}

// ---- sizes ----

TEST(ParseSize, PlainNumberIsBytes) {
  EXPECT_EQ(bytes_of("1073741824"), gib);
  EXPECT_EQ(bytes_of("1"), 1u);
  EXPECT_EQ(bytes_of("512B"), 512u);
}

TEST(ParseSize, BinarySuffixesInEveryCase) {
  const std::pair<const char*, std::uint64_t> cases[] = {
      {"3K", 3 * kib},   {"3k", 3 * kib},   {"3KiB", 3 * kib}, {"3kib", 3 * kib}, {"3KIB", 3 * kib},
      {"3M", 3 * mib},   {"3m", 3 * mib},   {"3MiB", 3 * mib}, {"3mib", 3 * mib}, {"3MIB", 3 * mib},
      {"6G", 6 * gib},   {"6g", 6 * gib},   {"6GiB", 6 * gib}, {"6gib", 6 * gib}, {"6GIB", 6 * gib},
      {"2T", 2 * tib},   {"2t", 2 * tib},   {"2TiB", 2 * tib}, {"2tib", 2 * tib}, {"2TIB", 2 * tib},
  };
  for (const auto& [text, expected] : cases) EXPECT_EQ(bytes_of(text), expected) << text;
}

TEST(ParseSize, DecimalSuffixesInEveryCase) {
  const std::pair<const char*, std::uint64_t> cases[] = {
      {"5KB", 5'000},           {"5kb", 5'000},           {"5Kb", 5'000},
      {"5MB", 5'000'000},       {"5mb", 5'000'000},       {"5GB", 5'000'000'000},
      {"5gb", 5'000'000'000},   {"5TB", 5'000'000'000'000}, {"5tb", 5'000'000'000'000},
  };
  for (const auto& [text, expected] : cases) EXPECT_EQ(bytes_of(text), expected) << text;
}

TEST(ParseSize, FractionsAreExactAndRoundDown) {
  EXPECT_EQ(bytes_of("1.5GiB"), gib + gib / 2);
  EXPECT_EQ(bytes_of("1.5G"), gib + gib / 2);
  EXPECT_EQ(bytes_of("0.5MiB"), mib / 2);
  EXPECT_EQ(bytes_of(".25K"), 256u);
  EXPECT_EQ(bytes_of("2.KiB"), 2 * kib);
  EXPECT_EQ(bytes_of("0.29KB"), 290u);  // 0.29 is not exact in binary floating point
  EXPECT_EQ(bytes_of("1.0000001K"), 1024u);
  EXPECT_EQ(bytes_of("2.5"), 2u);
}

TEST(ParseSize, SpacesAroundTheNumberAreIgnored) {
  EXPECT_EQ(bytes_of("  6GiB  "), 6 * gib);
  EXPECT_EQ(bytes_of("6 GiB"), 6 * gib);
  EXPECT_EQ(bytes_of("\t6\tGiB\n"), 6 * gib);
  const auto percent = parse_size("LAYERSWAP_BUDGET", " 75 % ", true);
  EXPECT_EQ(percent.how, size_setting::kind::percent);
  EXPECT_DOUBLE_EQ(percent.value, 75.0);
}

TEST(ParseSize, PercentResolvesAgainstTheDeviceTotal) {
  const auto p75 = parse_size("LAYERSWAP_BUDGET", "75%", true);
  ASSERT_EQ(p75.how, size_setting::kind::percent);
  EXPECT_EQ(p75.resolve(80 * gib), 60 * gib);
  EXPECT_EQ(p75.resolve(0), 0u);
  EXPECT_EQ(p75.resolve(3), 2u);  // 2.25 rounds down
  EXPECT_EQ(parse_size("LAYERSWAP_BUDGET", "100%", true).resolve(80 * gib + 7), 80 * gib + 7);
  EXPECT_EQ(parse_size("LAYERSWAP_BUDGET", "12.5%", true).resolve(8 * gib), gib);
  EXPECT_EQ(parse_size("LAYERSWAP_BUDGET", "0.5%", true).resolve(1000), 5u);
}

TEST(ParseSize, BytesResolveIgnoresTheDeviceTotal) {
  const auto size = parse_size("LAYERSWAP_BUDGET", "6GiB", true);
  EXPECT_EQ(size.resolve(80 * gib), 6 * gib);
  EXPECT_EQ(size.resolve(1), 6 * gib);
  EXPECT_EQ(size_setting{}.resolve(80 * gib), 0u);
  EXPECT_FALSE(size_setting{}.is_set());
  EXPECT_TRUE(size.is_set());
}

TEST(ParseSize, ToStringIsNormalized) {
  const auto text = [](const char* value) { return parse_size("LAYERSWAP_BUDGET", value, true).to_string(); };
  EXPECT_EQ(text("6GiB"), "6GiB");
  EXPECT_EQ(text("6144MiB"), "6GiB");
  EXPECT_EQ(text("6g"), "6GiB");
  EXPECT_EQ(text("1.5G"), "1536MiB");
  EXPECT_EQ(text("2TiB"), "2TiB");
  EXPECT_EQ(text("1GB"), "1GB");
  EXPECT_EQ(text("1073741824"), "1GiB");
  EXPECT_EQ(text("1234567"), "1234567B");
  EXPECT_EQ(text("75%"), "75%");
  EXPECT_EQ(text(" 12.5 %"), "12.5%");
  EXPECT_EQ(size_setting{}.to_string(), "none");
  // What to_string() writes parses back to the same size.
  for (const char* value : {"6GiB", "1.5G", "1GB", "1234567", "3KB", "75%", "12.5%"}) {
    const auto once = parse_size("LAYERSWAP_BUDGET", value, true);
    const auto again = parse_size("LAYERSWAP_BUDGET", once.to_string(), true);
    EXPECT_EQ(again.how, once.how) << value;
    EXPECT_DOUBLE_EQ(again.value, once.value) << value;
  }
}

TEST(ParseSize, LargestSizeIsTwoToThe63) {
  EXPECT_EQ(bytes_of("8388608TiB"), std::uint64_t{1} << 63);
  EXPECT_NE(size_error("LAYERSWAP_BUDGET", "8388608.001TiB", true), "");
}

// Every rejection names the variable, quotes the value and lists the accepted forms.
void expect_rejected(std::string_view name, std::string_view value, bool allow_percent, std::string_view problem) {
  const std::string message = size_error(name, value, allow_percent);
  ASSERT_NE(message, "") << name << "=" << value << " was accepted";
  EXPECT_EQ(message.rfind(std::string(name) + "=\"", 0), 0u) << message;
  EXPECT_NE(message.find("\"" + std::string(value) + "\""), std::string::npos) << message;
  EXPECT_NE(message.find(row(name).accepted), std::string::npos) << message;
  EXPECT_NE(message.find(problem), std::string::npos) << message;
}

TEST(ParseSize, RejectsBadValuesWithAHelpfulMessage) {
  expect_rejected("LAYERSWAP_BUDGET", "", true, "is empty");
  expect_rejected("LAYERSWAP_BUDGET", "   ", true, "is empty");
  expect_rejected("LAYERSWAP_BUDGET", "-1GiB", true, "negative");
  expect_rejected("LAYERSWAP_BUDGET", " -5", true, "negative");
  expect_rejected("LAYERSWAP_BUDGET", "0", true, "use none for no cap");
  expect_rejected("LAYERSWAP_BUDGET", "0GiB", true, "zero");
  expect_rejected("LAYERSWAP_BUDGET", "0.0001", true, "less than one byte");
  expect_rejected("LAYERSWAP_BUDGET", "0%", true, "zero");
  expect_rejected("LAYERSWAP_BUDGET", "nan", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "NaN", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "inf", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "infinity", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "6 gigs", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "GiB", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "6GiBs", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "1e9", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "0x10", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "1,5G", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "+6G", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "6 G iB", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", ".", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "101%", true, "more than 100%");
  expect_rejected("LAYERSWAP_BUDGET", "100.5%", true, "more than 100%");
  expect_rejected("LAYERSWAP_BUDGET", "99999999999999999999999%", true, "more than 100%");
  expect_rejected("LAYERSWAP_BUDGET", "75%%", true, "is not a size");
  expect_rejected("LAYERSWAP_BUDGET", "8388609TiB", true, "too large");
  expect_rejected("LAYERSWAP_BUDGET", "99999999999999999999999", true, "too large");
  expect_rejected("LAYERSWAP_VA_RESERVE", "50%", false, "percentage");
  expect_rejected("LAYERSWAP_VA_RESERVE", "0", false, "zero");
}

TEST(ParseSize, ZeroSaysUseNoneOnlyForTheBudget) {
  EXPECT_EQ(size_error("LAYERSWAP_VA_RESERVE", "0", false).find("none"), std::string::npos);
}

TEST(ParseSize, ValueInTheMessageIsEscaped) {
  const std::string message = size_error("LAYERSWAP_BUDGET", "6\"G\n", true);
  EXPECT_NE(message.find(R"("6\"G\x0a")"), std::string::npos) << message;
}

TEST(ParseSize, UnknownNameStillGetsAcceptedForms) {
  const std::string with_percent = size_error("budget", "lots", true);
  EXPECT_EQ(with_percent.rfind("budget=\"lots\" is not a size: use a size such as", 0), 0u) << with_percent;
  EXPECT_NE(with_percent.find("75%"), std::string::npos);
  const std::string without = size_error("budget", "lots", false);
  EXPECT_EQ(without.find('%'), std::string::npos) << without;
}

TEST(ParseSize, MessageHasTheDocumentedShape) {
  EXPECT_EQ(size_error("LAYERSWAP_BUDGET", "6 gigs", true),
            std::string("LAYERSWAP_BUDGET=\"6 gigs\" is not a size: use ") + row("LAYERSWAP_BUDGET").accepted);
}

// ---- parse_config ----

TEST(ParseConfig, EmptyIsAllDefaults) {
  const config c = parse_config(vars{});
  EXPECT_FALSE(c.enabled);
  EXPECT_FALSE(c.budget.is_set());
  EXPECT_EQ(c.log, log_level::warn);
  EXPECT_FALSE(c.stats);
  EXPECT_EQ(c.va_reserve, tib);
  EXPECT_TRUE(c.unknown.empty());
  EXPECT_EQ(c.given, 0u);
}

TEST(ParseConfig, BooleanForms) {
  for (const char* yes : {"1", "true", "TRUE", "True", "on", "ON", "yes", "Yes", " 1 "}) {
    EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_STATS", yes}}).stats) << yes;
    EXPECT_TRUE(parse_config(vars{{"LAYERSWAP", yes}}).enabled) << yes;
  }
  for (const char* no : {"0", "false", "FALSE", "off", "Off", "no", "NO", " 0\t"}) {
    EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_STATS", no}}).stats) << no;
    EXPECT_FALSE(parse_config(vars{{"LAYERSWAP", no}}).enabled) << no;
  }
}

TEST(ParseConfig, BadBooleanIsRejected) {
  for (const char* name : {"LAYERSWAP", "LAYERSWAP_STATS"}) {
    for (const char* bad : {"2", "maybe", "y", "enabled", "01", "-1"}) {
      const std::string message = config_error_of(vars{{name, bad}});
      EXPECT_EQ(message, std::string(name) + "=\"" + bad + "\" is not 0 or 1: use " + row(name).accepted);
    }
  }
}

TEST(ParseConfig, LogLevels) {
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_LOG", "warn"}}).log, log_level::warn);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_LOG", "info"}}).log, log_level::info);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_LOG", "debug"}}).log, log_level::debug);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_LOG", "DEBUG"}}).log, log_level::debug);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_LOG", " Info "}}).log, log_level::info);
  const std::string message = config_error_of(vars{{"LAYERSWAP_LOG", "verbose"}});
  EXPECT_EQ(message, "LAYERSWAP_LOG=\"verbose\" is not a log level: use warn, info or debug");
}

TEST(ParseConfig, LaterPairsOverrideEarlierOnes) {
  const config c = parse_config(vars{{"LAYERSWAP_BUDGET", "6GiB"},
                                     {"LAYERSWAP_LOG", "debug"},
                                     {"LAYERSWAP_BUDGET", "4GiB"},
                                     {"LAYERSWAP_LOG", "info"}});
  EXPECT_EQ(c.budget.resolve(0), 4 * gib);
  EXPECT_EQ(c.log, log_level::info);
}

TEST(ParseConfig, OnlyTheLastValueIsChecked) {
  // A bad value in the environment that enable() overrides is not an error...
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_BUDGET", "6 gigs"}, {"LAYERSWAP_BUDGET", "6GiB"}}).budget.resolve(0),
            6 * gib);
  // ...but a bad override is.
  EXPECT_NE(config_error_of(vars{{"LAYERSWAP_BUDGET", "6GiB"}, {"LAYERSWAP_BUDGET", "6 gigs"}}), "");
}

TEST(ParseConfig, EmptyValueIsUnset) {
  const config c = parse_config(vars{{"LAYERSWAP_BUDGET", ""}, {"LAYERSWAP_LOG", "  "}, {"LAYERSWAP_STATS", ""}});
  EXPECT_FALSE(c.budget.is_set());
  EXPECT_FALSE(c.enabled);
  EXPECT_EQ(c.log, log_level::warn);
  EXPECT_EQ(c.given, 0u);
  // An empty override restores the default.
  const config restored = parse_config(vars{{"LAYERSWAP_BUDGET", "6GiB"}, {"LAYERSWAP_BUDGET", ""}});
  EXPECT_FALSE(restored.budget.is_set());
  EXPECT_FALSE(restored.enabled);
  EXPECT_FALSE(restored.was_given("LAYERSWAP_BUDGET"));
}

TEST(ParseConfig, EnabledByLayerswapOne) {
  const config c = parse_config(vars{{"LAYERSWAP", "1"}});
  EXPECT_TRUE(c.enabled);
  EXPECT_FALSE(c.budget.is_set());
}

TEST(ParseConfig, EnabledByBudgetAlone) {
  const config c = parse_config(vars{{"LAYERSWAP_BUDGET", "6GiB"}});
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.budget.how, size_setting::kind::bytes);
  EXPECT_EQ(c.budget.resolve(80 * gib), 6 * gib);
  const config percent = parse_config(vars{{"LAYERSWAP_BUDGET", "75%"}});
  EXPECT_TRUE(percent.enabled);
  EXPECT_EQ(percent.budget.resolve(80 * gib), 60 * gib);
}

TEST(ParseConfig, ExplicitZeroWinsOverABudget) {
  const config c = parse_config(vars{{"LAYERSWAP", "0"}, {"LAYERSWAP_BUDGET", "6GiB"}});
  EXPECT_FALSE(c.enabled);
  EXPECT_EQ(c.budget.resolve(0), 6 * gib);  // still parsed (and checked)
  const config order = parse_config(vars{{"LAYERSWAP_BUDGET", "6GiB"}, {"LAYERSWAP", "off"}});
  EXPECT_FALSE(order.enabled);
  EXPECT_NE(config_error_of(vars{{"LAYERSWAP", "0"}, {"LAYERSWAP_BUDGET", "lots"}}), "");
}

TEST(ParseConfig, BudgetNoneIsNoCap) {
  for (const char* none : {"none", "None", "NONE", " none "}) {
    const config c = parse_config(vars{{"LAYERSWAP_BUDGET", none}});
    EXPECT_FALSE(c.budget.is_set()) << none;
    EXPECT_FALSE(c.enabled) << none;
    EXPECT_TRUE(c.was_given("LAYERSWAP_BUDGET")) << none;
  }
  const config on = parse_config(vars{{"LAYERSWAP", "1"}, {"LAYERSWAP_BUDGET", "none"}});
  EXPECT_TRUE(on.enabled);
  EXPECT_FALSE(on.budget.is_set());
}

TEST(ParseConfig, BudgetErrorsComeThroughParseConfig) {
  const std::string zero = config_error_of(vars{{"LAYERSWAP_BUDGET", "0"}});
  EXPECT_NE(zero.find("LAYERSWAP_BUDGET=\"0\""), std::string::npos) << zero;
  EXPECT_NE(zero.find("use none for no cap"), std::string::npos) << zero;
  const std::string garbage = config_error_of(vars{{"LAYERSWAP_BUDGET", "6 gigs"}});
  EXPECT_EQ(garbage.rfind("LAYERSWAP_BUDGET=\"6 gigs\" is not a size: use a size such as 6GiB, 6144MiB", 0), 0u)
      << garbage;
}

TEST(ParseConfig, VaReserve) {
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_VA_RESERVE", "256GiB"}}).va_reserve, 256 * gib);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_VA_RESERVE", "2MiB"}}).va_reserve, 2 * mib);
  // Rounded up to whole 2 MiB granules.
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_VA_RESERVE", "3MiB"}}).va_reserve, 4 * mib);
  const std::string small = config_error_of(vars{{"LAYERSWAP_VA_RESERVE", "1MiB"}});
  EXPECT_EQ(small, std::string("LAYERSWAP_VA_RESERVE=\"1MiB\" is less than 2MiB: use ") +
                       row("LAYERSWAP_VA_RESERVE").accepted);
  const std::string percent = config_error_of(vars{{"LAYERSWAP_VA_RESERVE", "50%"}});
  EXPECT_NE(percent.find("percentage"), std::string::npos) << percent;
  // Setting it does not enable layerswap.
  EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_VA_RESERVE", "256GiB"}}).enabled);
}

TEST(ParseConfig, OtherNamesAreIgnored) {
  const config c = parse_config(vars{{"PATH", "/bin"},
                                     {"layerswap_budget", "6GiB"},
                                     {"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"},
                                     {"XLAYERSWAP_BUDGET", "1"}});
  EXPECT_FALSE(c.enabled);
  EXPECT_FALSE(c.budget.is_set());
  EXPECT_TRUE(c.unknown.empty());
}

TEST(ParseConfig, UnknownNameWithASuggestion) {
  const config c = parse_config(vars{{"LAYERSWAP_BUGDET", "6GiB"}});
  ASSERT_EQ(c.unknown.size(), 1u);
  EXPECT_EQ(c.unknown[0], "unknown setting LAYERSWAP_BUGDET=6GiB (did you mean LAYERSWAP_BUDGET?)");
  EXPECT_FALSE(c.enabled);  // the misspelt budget turns nothing on
}

TEST(ParseConfig, UnknownNamesWithSuggestionsForEachKind) {
  const config c = parse_config(vars{{"LAYERSWAP_STAT", "1"},
                                     {"LAYERSWAP_budget", "1G"},
                                     {"LAYERSWAPX", "1"},
                                     {"LAYERSWAP_VA_RESERV", "1TiB"},
                                     {"LAYERSWAP_LGO", "info"}});
  ASSERT_EQ(c.unknown.size(), 5u);
  EXPECT_EQ(c.unknown[0], "unknown setting LAYERSWAP_STAT=1 (did you mean LAYERSWAP_STATS?)");
  EXPECT_EQ(c.unknown[1], "unknown setting LAYERSWAP_budget=1G (did you mean LAYERSWAP_BUDGET?)");
  EXPECT_EQ(c.unknown[2], "unknown setting LAYERSWAPX=1 (did you mean LAYERSWAP?)");
  EXPECT_EQ(c.unknown[3], "unknown setting LAYERSWAP_VA_RESERV=1TiB (did you mean LAYERSWAP_VA_RESERVE?)");
  EXPECT_EQ(c.unknown[4], "unknown setting LAYERSWAP_LGO=info (did you mean LAYERSWAP_LOG?)");
}

TEST(ParseConfig, UnknownNameWithoutASuggestion) {
  const config c = parse_config(vars{{"LAYERSWAP_COMPLETELY_DIFFERENT", "x"}, {"LAYERSWAP_FOO", "1"}});
  ASSERT_EQ(c.unknown.size(), 2u);
  EXPECT_EQ(c.unknown[0], "unknown setting LAYERSWAP_COMPLETELY_DIFFERENT=x");
  EXPECT_EQ(c.unknown[1], "unknown setting LAYERSWAP_FOO=1");
}

TEST(ParseConfig, UnknownNameRepeatedIsReportedOnceWithItsLastValue) {
  const config c = parse_config(vars{{"LAYERSWAP_BUGDET", "6GiB"}, {"LAYERSWAP_BUGDET", "8GiB"}});
  ASSERT_EQ(c.unknown.size(), 1u);
  EXPECT_NE(c.unknown[0].find("LAYERSWAP_BUGDET=8GiB"), std::string::npos) << c.unknown[0];
}

TEST(ParseConfig, UnknownNamesDoNotHideBadValues) {
  EXPECT_NE(config_error_of(vars{{"LAYERSWAP_BUGDET", "6GiB"}, {"LAYERSWAP_LOG", "loud"}}), "");
}

TEST(ClosestSetting, FindsTyposAndRefusesStrangers) {
  EXPECT_EQ(closest_setting("LAYERSWAP_BUGDET"), "LAYERSWAP_BUDGET");
  EXPECT_EQ(closest_setting("layerswap_budgte"), "LAYERSWAP_BUDGET");
  EXPECT_EQ(closest_setting("LAYERSWAP_BUDGETT"), "LAYERSWAP_BUDGET");
  EXPECT_EQ(closest_setting("LAYERSWAP_STATZ"), "LAYERSWAP_STATS");
  EXPECT_EQ(closest_setting("LAYERSWAP_VARESERVE"), "LAYERSWAP_VA_RESERVE");
  EXPECT_EQ(closest_setting("LAYERSWAP_LOGS"), "LAYERSWAP_LOG");
  EXPECT_EQ(closest_setting("LAYERSWAP_BUDGET"), "LAYERSWAP_BUDGET");
  // Without the prefix, as enable() spells settings.
  EXPECT_EQ(closest_setting("bugdet"), "LAYERSWAP_BUDGET");
  EXPECT_EQ(closest_setting("va_reserv"), "LAYERSWAP_VA_RESERVE");
  EXPECT_EQ(closest_setting("LAYERSWAP_COMPLETELY_DIFFERENT"), "");
  EXPECT_EQ(closest_setting("LAYERSWAP_FOO"), "");
  EXPECT_EQ(closest_setting("LAYERSWAP_DEBUG"), "");
  // Close enough to a real *_LIMIT setting to be worth the hint.
  EXPECT_EQ(closest_setting("LAYERSWAP_BUDGET_LIMIT"), "LAYERSWAP_HOST_LIMIT");
  EXPECT_EQ(closest_setting("verbose"), "");
}

// ---- describe ----

TEST(Describe, DefaultsAreMarked) {
  const std::string text = parse_config(vars{}).describe();
  EXPECT_EQ(text,
            "LAYERSWAP=0  (default)\n"
            "LAYERSWAP_BUDGET=none  (default)\n"
            "LAYERSWAP_LOG=warn  (default)\n"
            "LAYERSWAP_STATS=0  (default)\n"
            "LAYERSWAP_VA_RESERVE=1TiB  (default)\n"
            "LAYERSWAP_TRACK=auto  (default)\n"
            "LAYERSWAP_TRACK_API=driver  (default)\n"
            "LAYERSWAP_TRACE=none  (default)\n"
            "LAYERSWAP_PREFETCH=auto  (default)\n"
            "LAYERSWAP_PIN=none  (default)\n"
            "LAYERSWAP_HOST_LIMIT=none  (default)\n"
            "LAYERSWAP_HOLD=0  (default)\n"
            "LAYERSWAP_WRITEBACK=skip-clean  (default)\n"
            "LAYERSWAP_OVERSIZE=1  (default)\n"
            "LAYERSWAP_CACHE_RESERVE=none  (default)\n"
            "LAYERSWAP_COMPOSITES=0  (default)\n"
            "LAYERSWAP_SPLIT=8/32  (default)\n"
            "LAYERSWAP_SPLIT_FREE=12.5%/25%  (default)\n"
            "LAYERSWAP_RECLAIM=fit  (default)\n"
            "LAYERSWAP_RESERVE=auto  (default)\n"
            "LAYERSWAP_PROGRAM_FIRST=1  (default)\n");
}

TEST(Describe, GivenValuesAreNormalizedAndUnknownsFollow) {
  const config c = parse_config(vars{{"LAYERSWAP_BUDGET", "6144mib"},
                                     {"LAYERSWAP_LOG", "DEBUG"},
                                     {"LAYERSWAP_STATS", "yes"},
                                     {"LAYERSWAP_VA_RESERVE", "256 GiB"},
                                     {"LAYERSWAP_BUGDET", "1"}});
  EXPECT_EQ(c.describe(),
            "LAYERSWAP=1  (default; on because LAYERSWAP_BUDGET is set)\n"
            "LAYERSWAP_BUDGET=6GiB\n"
            "LAYERSWAP_LOG=debug\n"
            "LAYERSWAP_STATS=1\n"
            "LAYERSWAP_VA_RESERVE=256GiB\n"
            "LAYERSWAP_TRACK=auto  (default)\n"
            "LAYERSWAP_TRACK_API=driver  (default)\n"
            "LAYERSWAP_TRACE=none  (default)\n"
            "LAYERSWAP_PREFETCH=auto  (default)\n"
            "LAYERSWAP_PIN=none  (default)\n"
            "LAYERSWAP_HOST_LIMIT=none  (default)\n"
            "LAYERSWAP_HOLD=0  (default)\n"
            "LAYERSWAP_WRITEBACK=skip-clean  (default)\n"
            "LAYERSWAP_OVERSIZE=1  (default)\n"
            "LAYERSWAP_CACHE_RESERVE=none  (default)\n"
            "LAYERSWAP_COMPOSITES=0  (default)\n"
            "LAYERSWAP_SPLIT=8/32  (default)\n"
            "LAYERSWAP_SPLIT_FREE=12.5%/25%  (default)\n"
            "LAYERSWAP_RECLAIM=fit  (default)\n"
            "LAYERSWAP_RESERVE=auto  (default)\n"
            "LAYERSWAP_PROGRAM_FIRST=1  (default)\n"
            "unknown setting LAYERSWAP_BUGDET=1 (did you mean LAYERSWAP_BUDGET?)\n");
}

TEST(Describe, ExplicitValuesEqualToTheDefaultAreNotMarked) {
  const config c = parse_config(vars{{"LAYERSWAP", "0"}, {"LAYERSWAP_BUDGET", "75%"}, {"LAYERSWAP_LOG", "warn"}});
  const std::string text = c.describe();
  EXPECT_NE(text.find("LAYERSWAP=0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("LAYERSWAP_BUDGET=75%\n"), std::string::npos) << text;
  EXPECT_NE(text.find("LAYERSWAP_LOG=warn\n"), std::string::npos) << text;
  EXPECT_NE(text.find("LAYERSWAP_STATS=0  (default)\n"), std::string::npos) << text;
  EXPECT_TRUE(c.was_given("LAYERSWAP"));
  EXPECT_TRUE(c.was_given("LAYERSWAP_LOG"));
  EXPECT_FALSE(c.was_given("LAYERSWAP_STATS"));
  EXPECT_FALSE(c.was_given("LAYERSWAP_NOPE"));
}

// ---- the process environment ----

class EnvironmentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Start from an environment without LAYERSWAP* variables (the test runner's own are put back after).
    for (const auto& [name, value] : environment_settings()) {
      saved_.emplace_back(name, value);
      ::unsetenv(name.c_str());
    }
  }
  void TearDown() override {
    for (const char* name : {"LAYERSWAP_BUDGET", "LAYERSWAP_LOG", "LAYERSWAP_BUGDET", "LAYERSWAP", "NOT_LAYERSWAP"}) {
      ::unsetenv(name);
    }
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
  }
  vars saved_;
};

TEST_F(EnvironmentTest, CollectsOnlyLayerswapVariables) {
  EXPECT_TRUE(environment_settings().empty());
  ASSERT_EQ(::setenv("LAYERSWAP_BUDGET", "6GiB", 1), 0);
  ASSERT_EQ(::setenv("LAYERSWAP_LOG", "a=b", 1), 0);
  ASSERT_EQ(::setenv("LAYERSWAP_BUGDET", "", 1), 0);
  ASSERT_EQ(::setenv("NOT_LAYERSWAP", "1", 1), 0);
  auto found = environment_settings();
  std::sort(found.begin(), found.end());
  EXPECT_EQ(found, (vars{{"LAYERSWAP_BUDGET", "6GiB"}, {"LAYERSWAP_BUGDET", ""}, {"LAYERSWAP_LOG", "a=b"}}));

  ::unsetenv("LAYERSWAP_BUDGET");
  found = environment_settings();
  EXPECT_EQ(found.size(), 2u);
}

TEST_F(EnvironmentTest, FeedsParseConfigAndOverridesWin) {
  ASSERT_EQ(::setenv("LAYERSWAP_BUDGET", "6GiB", 1), 0);
  ASSERT_EQ(::setenv("LAYERSWAP_LOG", "info", 1), 0);
  auto settings = environment_settings();
  EXPECT_EQ(parse_config(settings).budget.resolve(0), 6 * gib);
  settings.emplace_back("LAYERSWAP_BUDGET", "2GiB");  // what enable(budget="2GiB") appends
  const config c = parse_config(settings);
  EXPECT_EQ(c.budget.resolve(0), 2 * gib);
  EXPECT_EQ(c.log, log_level::info);
  EXPECT_TRUE(c.enabled);
}

// ---- format_bytes ----

TEST(FormatBytes, BinaryUnitsWithTwoDecimals) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(6 * gib), "6.00 GiB");
  EXPECT_EQ(format_bytes(gib + gib / 4), "1.25 GiB");
  EXPECT_EQ(format_bytes(3 * tib), "3.00 TiB");
  EXPECT_EQ(format_bytes(mib - 1), "1.00 MiB");  // not "1024.00 KiB"
  EXPECT_EQ(format_bytes(std::uint64_t{1} << 63), "8.00 EiB");
  EXPECT_EQ(format_bytes(~std::uint64_t{0}), "16.00 EiB");
}

// ---- logging ----

// Runs `body` with stderr redirected to a temporary file and returns what it wrote.
template <class F>
std::string capture_stderr(F body) {
  std::FILE* file = std::tmpfile();
  EXPECT_NE(file, nullptr);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(::fileno(file), STDERR_FILENO);
  body();
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::string out;
  std::rewind(file);
  char chunk[512];
  std::size_t got;
  while ((got = std::fread(chunk, 1, sizeof chunk, file)) > 0) out.append(chunk, got);
  std::fclose(file);
  return out;
}

class LogTest : public ::testing::Test {
 protected:
  void TearDown() override { set_log_level(log_level::warn); }
};

TEST_F(LogTest, DefaultLevelIsWarn) {
  EXPECT_TRUE(log_enabled(log_level::warn));
  EXPECT_FALSE(log_enabled(log_level::info));
  EXPECT_FALSE(log_enabled(log_level::debug));
}

TEST_F(LogTest, OneLinePerMessageWithThePrefix) {
  const std::string out = capture_stderr([] {
    LAYERSWAP_LOG(warn, "budget %s is small", "1GiB");
    LAYERSWAP_LOG(info, "not shown %d", 1);
    set_log_level(log_level::debug);
    LAYERSWAP_LOG(info, "shown %d", 2);
    LAYERSWAP_LOG(debug, "ends in a newline\n");
  });
  EXPECT_EQ(out,
            "layerswap: warning: budget 1GiB is small\n"
            "layerswap: shown 2\n"
            "layerswap: ends in a newline\n");
}

TEST_F(LogTest, ArgumentsAreNotEvaluatedWhenDisabled) {
  int evaluated = 0;
  const std::string out = capture_stderr([&] { LAYERSWAP_LOG(debug, "%d", ++evaluated); });
  EXPECT_EQ(evaluated, 0);
  EXPECT_EQ(out, "");
}

TEST_F(LogTest, LongMessagesAreCutToOneLineAndErrnoIsKept) {
  const std::string long_text(5000, 'x');
  errno = ENOENT;
  const std::string out = capture_stderr([&] { LAYERSWAP_LOG(warn, "%s", long_text.c_str()); });
  EXPECT_EQ(errno, ENOENT);
  ASSERT_LE(out.size(), 1024u);
  EXPECT_GT(out.size(), 900u);
  EXPECT_EQ(out.rfind("layerswap: warning: xxx", 0), 0u);
  EXPECT_EQ(out.substr(out.size() - 4), "...\n");
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
}

// ---- swapping settings ----

TEST(SwapSettings, ParseAndRejectNamingTheVariable) {
  config c = parse_config(vars{{"LAYERSWAP_PREFETCH", "8"}, {"LAYERSWAP_PIN", "first:2, last:3"},
                               {"LAYERSWAP_HOST_LIMIT", "64GiB"}});
  EXPECT_EQ(c.prefetch, 8u);
  EXPECT_EQ(c.pin_first, 2u);
  EXPECT_EQ(c.pin_last, 3u);
  EXPECT_EQ(c.pin_bytes, 0u);
  EXPECT_EQ(c.host_limit, std::size_t{64} << 30);
  c = parse_config(vars{{"LAYERSWAP_PREFETCH", "auto"}, {"LAYERSWAP_PIN", "2GiB"}, {"LAYERSWAP_HOST_LIMIT", "none"}});
  EXPECT_EQ(c.prefetch, 0u);
  EXPECT_EQ(c.pin_bytes, std::size_t{2} << 30);
  EXPECT_EQ(c.host_limit, 0u);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_PIN", "last:1"}}).pin_last, 1u);
  {
    const config tuned = parse_config(vars{{"LAYERSWAP_PREFETCH", " Tune "}});  // Note [Tuned prefetch]
    EXPECT_TRUE(tuned.prefetch_tune);
    EXPECT_EQ(tuned.prefetch, 0u);
    EXPECT_NE(tuned.describe().find("LAYERSWAP_PREFETCH=tune\n"), std::string::npos) << tuned.describe();
    EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_PREFETCH", "8"}}).prefetch_tune);
    const std::string why = config_error_of(vars{{"LAYERSWAP_PREFETCH", "tuned"}});
    EXPECT_NE(why.find("auto, tune, or a number of regions"), std::string::npos) << why;
  }
  EXPECT_FALSE(parse_config(vars{}).writeback_always);
  EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_WRITEBACK", "Skip-Clean"}}).writeback_always);
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_WRITEBACK", " always "}}).writeback_always);
  EXPECT_EQ(parse_config(vars{}).oversize, 1.0);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_OVERSIZE", " 2 "}}).oversize, 2.0);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_OVERSIZE", "1.5"}}).oversize, 1.5);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_OVERSIZE", "1.5"}}).describe().find("LAYERSWAP_OVERSIZE=1.5\n"),
            std::string::npos);
  EXPECT_TRUE(parse_config(vars{}).program_first);
  EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_PROGRAM_FIRST", " off "}}).program_first);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_PROGRAM_FIRST", "0"}}).describe().find("LAYERSWAP_PROGRAM_FIRST=0\n"),
            std::string::npos);
  EXPECT_FALSE(parse_config(vars{}).composites);
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_COMPOSITES", " on "}}).composites);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_COMPOSITES", "1"}}).describe().find("LAYERSWAP_COMPOSITES=1\n"),
            std::string::npos);
  EXPECT_EQ(parse_config(vars{}).split, 8u);
  EXPECT_EQ(parse_config(vars{}).split_peak, 32u);  // Note [Splits by reserve]
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT", "16"}}).split_peak, 16u) << "one number sets both";
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT", "off"}}).split_peak, 0u);
  {
    const config c = parse_config(vars{{"LAYERSWAP_SPLIT", " 4 / on "}});
    EXPECT_EQ(c.split, 4u);
    EXPECT_EQ(c.split_peak, 4u);
    EXPECT_NE(c.describe().find("LAYERSWAP_SPLIT=4\n"), std::string::npos) << c.describe();
  }
  {
    const config c = parse_config(vars{{"LAYERSWAP_SPLIT", "2/64"}});
    EXPECT_EQ(c.split, 2u);
    EXPECT_EQ(c.split_peak, 64u);
    EXPECT_NE(c.describe().find("LAYERSWAP_SPLIT=2/64\n"), std::string::npos) << c.describe();
  }
  for (const char* bad : {"8/0", "0/8", "8/", "/8", "8/32/4", "8/x"}) {
    const std::string why = config_error_of(vars{{"LAYERSWAP_SPLIT", bad}});
    EXPECT_NE(why.find("LAYERSWAP_SPLIT"), std::string::npos) << bad << ": " << why;
    EXPECT_NE(why.find("F/P"), std::string::npos) << bad << ": " << why;
  }
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT", " on "}}).split, 4u);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT", "1"}}).split, 4u);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT", "off"}}).split, 0u);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT", "16"}}).split, 16u);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_SPLIT", "16"}}).describe().find("LAYERSWAP_SPLIT=16\n"), std::string::npos);
  for (const char* bad : {"1025", "1.5", "-2", "many"}) {
    const std::string why = config_error_of(vars{{"LAYERSWAP_SPLIT", bad}});
    EXPECT_NE(why.find("LAYERSWAP_SPLIT"), std::string::npos) << bad << ": " << why;
    EXPECT_NE(why.find("2 to 1024"), std::string::npos) << bad << ": " << why;
  }
  // Note [Split bound]: a percentage of the budget by default, a size, or none.
  EXPECT_EQ(parse_config(vars{}).split_free.how, size_setting::kind::percent);
  EXPECT_EQ(parse_config(vars{}).split_free.value, 12.5);
  EXPECT_EQ(parse_config(vars{}).split_free.resolve(std::size_t{8} << 30), std::size_t{1} << 30);
  EXPECT_EQ(parse_config(vars{}).split_free_peak.resolve(std::size_t{8} << 30), std::size_t{2} << 30);
  {  // F/P, each part any of the single forms; one value sets both
    const config c = parse_config(vars{{"LAYERSWAP_SPLIT_FREE", " none / 1GiB "}});
    EXPECT_FALSE(c.split_free.is_set());
    EXPECT_EQ(c.split_free_peak.resolve(std::size_t{8} << 30), std::size_t{1} << 30);
    EXPECT_NE(c.describe().find("LAYERSWAP_SPLIT_FREE=none/1GiB\n"), std::string::npos) << c.describe();
    const config one = parse_config(vars{{"LAYERSWAP_SPLIT_FREE", "10%"}});
    EXPECT_EQ(one.split_free_peak, one.split_free);
    EXPECT_NE(one.describe().find("LAYERSWAP_SPLIT_FREE=10%\n"), std::string::npos) << one.describe();
  }
  for (const char* bad : {"12.5%/", "/25%", "12.5%/lots", "1%/2%/3%"}) {
    const std::string why = config_error_of(vars{{"LAYERSWAP_SPLIT_FREE", bad}});
    EXPECT_NE(why.find("LAYERSWAP_SPLIT_FREE"), std::string::npos) << bad << ": " << why;
  }
  EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_SPLIT_FREE", " None "}}).split_free.is_set());
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT_FREE", "512MiB"}}).split_free.resolve(std::size_t{8} << 30),
            std::size_t{512} << 20);
  EXPECT_EQ(parse_config(vars{{"LAYERSWAP_SPLIT_FREE", "25%"}}).split_free.resolve(std::size_t{8} << 30),
            std::size_t{2} << 30);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_SPLIT_FREE", "none"}}).describe().find("LAYERSWAP_SPLIT_FREE=none\n"),
            std::string::npos);
  for (const char* bad : {"0", "0%", "101%", "-1GiB", "lots"}) {
    const std::string why = config_error_of(vars{{"LAYERSWAP_SPLIT_FREE", bad}});
    EXPECT_NE(why.find("LAYERSWAP_SPLIT_FREE"), std::string::npos) << bad << ": " << why;
    EXPECT_NE(why.find("a percentage of the budget"), std::string::npos) << bad << ": " << why;
  }
  EXPECT_TRUE(parse_config(vars{}).reclaim_fit);
  EXPECT_FALSE(parse_config(vars{{"LAYERSWAP_RECLAIM", " Oldest "}}).reclaim_fit);
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_RECLAIM", "fit"}}).reclaim_fit);
  EXPECT_NE(config_error_of(vars{{"LAYERSWAP_RECLAIM", "lru"}}).find("LAYERSWAP_RECLAIM"), std::string::npos);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_RECLAIM", "oldest"}}).describe().find("LAYERSWAP_RECLAIM=oldest\n"),
            std::string::npos);
  {  // auto by default (Note [Automatic reserve]): follows the step, a lead of 2 64ths, while the evictions are clean
    const config c = parse_config(vars{});
    EXPECT_EQ(c.reserve, reserve_mode::automatic);
    EXPECT_EQ(c.reserve_ahead, 2u);
  }
  {
    const config c = parse_config(vars{{"LAYERSWAP_RESERVE", " Peak "}});
    EXPECT_EQ(c.reserve, reserve_mode::peak);
    EXPECT_NE(c.describe().find("LAYERSWAP_RESERVE=peak\n"), std::string::npos) << c.describe();
  }
  {
    const config c = parse_config(vars{{"LAYERSWAP_RESERVE", "follow"}});
    EXPECT_EQ(c.reserve, reserve_mode::follow);
    EXPECT_EQ(c.reserve_ahead, 2u);
    EXPECT_NE(c.describe().find("LAYERSWAP_RESERVE=follow\n"), std::string::npos) << c.describe();
  }
  {
    const config c = parse_config(vars{{"LAYERSWAP_RESERVE", "AUTO"}});
    EXPECT_EQ(c.reserve, reserve_mode::automatic);
    EXPECT_EQ(c.reserve_ahead, 2u);
    EXPECT_NE(c.describe().find("LAYERSWAP_RESERVE=auto\n"), std::string::npos) << c.describe();
  }
  for (const auto& [text, ahead, automatic] : std::vector<std::tuple<std::string, std::uint32_t, bool>>{
           {"follow:0", 0, false}, {"FOLLOW: 8", 8, false}, {"follow:32", 32, false}, {"follow:04", 4, false},
           {"auto:4", 4, true}, {"Auto: 16", 16, true}, {"auto:0", 0, true}}) {
    const config c = parse_config(vars{{"LAYERSWAP_RESERVE", text}});
    EXPECT_EQ(c.reserve, automatic ? reserve_mode::automatic : reserve_mode::follow) << text;
    EXPECT_EQ(c.reserve_ahead, ahead) << text;
  }
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_RESERVE", "follow:8"}}).describe().find("LAYERSWAP_RESERVE=follow:8\n"),
            std::string::npos);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_RESERVE", "auto:4"}}).describe().find("LAYERSWAP_RESERVE=auto:4\n"),
            std::string::npos);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_RESERVE", "auto:2"}}).describe().find("LAYERSWAP_RESERVE=auto\n"),
            std::string::npos);
  for (const char* bad : {"max", "follow:", "follow:33", "follow:-1", "follow:x", "follow:100", "follow 4", "auto:",
                          "auto:33", "auto 8", "autofollow", "peak:4"}) {
    const std::string why = config_error_of(vars{{"LAYERSWAP_RESERVE", bad}});
    EXPECT_NE(why.find("LAYERSWAP_RESERVE"), std::string::npos) << bad << ": " << why;
    EXPECT_NE(why.find("auto:N or follow:N"), std::string::npos) << bad << ": " << why;
  }
  EXPECT_FALSE(parse_config(vars{}).cache_reserve_auto);  // none by default
  EXPECT_EQ(parse_config(vars{}).cache_reserve, 0u);
  EXPECT_TRUE(parse_config(vars{{"LAYERSWAP_CACHE_RESERVE", " Auto "}}).cache_reserve_auto);
  EXPECT_NE(parse_config(vars{{"LAYERSWAP_CACHE_RESERVE", "auto"}}).describe().find("LAYERSWAP_CACHE_RESERVE=auto\n"),
            std::string::npos);
  for (const char* off : {"none", "0", " NONE "}) {
    const config c = parse_config(vars{{"LAYERSWAP_CACHE_RESERVE", off}});
    EXPECT_FALSE(c.cache_reserve_auto) << off;
    EXPECT_EQ(c.cache_reserve, 0u) << off;
    EXPECT_NE(c.describe().find("LAYERSWAP_CACHE_RESERVE=none\n"), std::string::npos) << off;
  }
  {
    const config c = parse_config(vars{{"LAYERSWAP_CACHE_RESERVE", "256MiB"}});
    EXPECT_FALSE(c.cache_reserve_auto);
    EXPECT_EQ(c.cache_reserve, std::size_t{256} << 20);
    EXPECT_NE(c.describe().find("LAYERSWAP_CACHE_RESERVE=256MiB\n"), std::string::npos) << c.describe();
  }
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{
           {"LAYERSWAP_CACHE_RESERVE", "some"}, {"LAYERSWAP_CACHE_RESERVE", "10%"},
           {"LAYERSWAP_CACHE_RESERVE", "-1MiB"}, {"LAYERSWAP_OVERSIZE", "0.5"}, {"LAYERSWAP_OVERSIZE", "17"}, {"LAYERSWAP_OVERSIZE", "nan"},
           {"LAYERSWAP_OVERSIZE", "inf"}, {"LAYERSWAP_OVERSIZE", "2x"}, {"LAYERSWAP_OVERSIZE", "0x2"},
           {"LAYERSWAP_PREFETCH", "0"}, {"LAYERSWAP_PREFETCH", "many"}, {"LAYERSWAP_PIN", "middle:2"},
           {"LAYERSWAP_PIN", "first:x"}, {"LAYERSWAP_PIN", "first"}, {"LAYERSWAP_HOST_LIMIT", "lots"},
           {"LAYERSWAP_WRITEBACK", "sometimes"}, {"LAYERSWAP_COMPOSITES", "maybe"},
           {"LAYERSWAP_PROGRAM_FIRST", "later"}}) {
    const std::string why = config_error_of(vars{{name, value}});
    EXPECT_NE(why.find(name), std::string::npos) << why;
    EXPECT_NE(why.find(value), std::string::npos) << why;
  }
}

}  // namespace
}  // namespace layerswap
