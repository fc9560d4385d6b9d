// The HTML report: its sections, one point per configuration in each
// frontier chart, one heatmap per configuration, escaping, balanced tags,
// nothing fetched, the atomic write; and the page rendered by headless
// Chromium, whose screenshot is decoded (tests/check_report_screenshot.py)
// and checked for the header, the table and the charts where they belong.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <regex>
#include <set>

#include "eval/evaluation_report.h"
#include "formats/input_error.h"
#include "tests/sample_evaluation.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++count;
  return count;
}

// The text of the element that starts at the first `open` (e.g. "<section
// id=\"frontier\"") up to the matching close of its tag name.
std::string element(const std::string& html, const std::string& open) {
  const auto begin = html.find(open);
  if (begin == std::string::npos) return "";
  const std::string name = open.substr(1, open.find_first_of(" >", 1) - 1);
  int depth = 0;
  for (auto at = begin; at < html.size(); ++at) {
    if (html.compare(at, name.size() + 1, "<" + name) == 0 &&
        (html[at + name.size() + 1] == ' ' || html[at + name.size() + 1] == '>')) {
      ++depth;
    } else if (html.compare(at, name.size() + 3, "</" + name + ">") == 0 && --depth == 0) {
      return html.substr(begin, at + name.size() + 3 - begin);
    }
  }
  return "";
}

// Every opened element is closed, in order (void elements and "/>" aside),
// and every '<' starts a tag: what a browser needs to build the tree we meant.
std::string tag_balance_error(const std::string& html) {
  static const std::set<std::string> kVoid = {"meta", "br", "hr", "img", "input", "link", "col", "wbr", "source"};
  std::vector<std::string> open;
  std::size_t at = 0;
  while ((at = html.find('<', at)) != std::string::npos) {
    const auto end = html.find('>', at);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(at);
    const std::string tag = html.substr(at + 1, end - at - 1);
    at = end + 1;
    if (tag.rfind("!DOCTYPE", 0) == 0) continue;
    if (tag.empty() || !(std::isalpha(static_cast<unsigned char>(tag[0])) || tag[0] == '/')) {
      return "a '<' that starts no tag: <" + tag + ">";
    }
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) {
        return "</" + name + "> closes " + (open.empty() ? std::string("nothing") : "<" + open.back() + ">");
      }
      open.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \n\t/"));
    if (tag.back() == '/' || kVoid.count(name)) continue;
    open.push_back(name);
    if (name == "style") {  // CSS is not markup
      at = html.find("</style>", at);
      if (at == std::string::npos) return "unclosed <style>";
    }
  }
  return open.empty() ? "" : "unclosed <" + open.back() + ">";
}

std::vector<std::string> data_configs(const std::string& html, const std::string& element_start) {
  std::vector<std::string> names;
  const std::regex pattern(element_start + " data-config=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), pattern); it != std::sregex_iterator(); ++it) {
    names.push_back((*it)[1]);
  }
  return names;
}

TEST(EvaluationReport, HasEverySectionInOrder) {
  const std::string html = render_evaluation_report(testing::sample_evaluation());
  EXPECT_EQ(html.rfind("<!DOCTYPE html>\n<html lang=\"en\">", 0), 0u);
  std::size_t previous = 0;
  for (const char* id : {"id=\"header\"", "id=\"comparison\"", "id=\"frontier\"", "id=\"attention\"", "id=\"needles\"",
                         "id=\"tasks\""}) {
    const auto at = html.find(id);
    ASSERT_NE(at, std::string::npos) << id;
    EXPECT_GT(at, previous) << id;
    previous = at;
  }
  for (const char* header : {"/work/shared/models/pyllama-16m", "out/demo/artifact.h5", "/work/shared/data/heldout.txt",
                             "cpu", "2025-06-01T12:00:00Z", "512 tokens, prefill chunks of 128",
                             "--gate &#39;needle&gt;=0.98*fp16,ppl&lt;=1.03*fp16&#39;"}) {
    EXPECT_NE(element(html, "<header").find(header), std::string::npos) << header;
  }
}

TEST(EvaluationReport, TheComparisonTableHasARowPerConfiguration) {
  const std::string table = element(render_evaluation_report(testing::sample_evaluation()), "<section class=\"panel\" id=\"comparison\"");
  EXPECT_EQ(count_of(table, "<tr"), 5u);  // header + 4 configurations
  for (const char* cell : {"kvquant+rot", "21.020", "+2.54%", "93.10%", "98.3%", "<th>attn error</th>"}) {
    EXPECT_NE(table.find(cell), std::string::npos) << cell;
  }
}

TEST(EvaluationReport, EachFrontierChartHasOnePointPerConfiguration) {
  const Evaluation e = testing::sample_evaluation();
  const std::string frontier = element(render_evaluation_report(e), "<section class=\"panel\" id=\"frontier\"");
  const std::vector<std::string> names = {"fp16", "kvquant-2bit", "kivi-2bit", "rtn-2bit"};
  std::size_t charts = 0;
  for (auto at = frontier.find("<figure>"); at != std::string::npos; at = frontier.find("<figure>", at + 1)) {
    const std::string chart = element(frontier.substr(at), "<figure>");
    EXPECT_EQ(data_configs(chart, "<circle class=\"point\""), names) << chart.substr(0, 80);
    for (const std::string& name : names) {
      EXPECT_NE(chart.find("<text class=\"point-label\"" ), std::string::npos);
      EXPECT_NE(chart.find(">" + name + "</text>"), std::string::npos) << name << " has no label";
    }
    ++charts;
  }
  EXPECT_EQ(charts, 3u);  // perplexity, KL, needle accuracy
}

TEST(EvaluationReport, AttentionChartsHaveALinePerQuantizedConfigurationAndHeatmapsOnePerConfiguration) {
  const std::string html = render_evaluation_report(testing::sample_evaluation());
  const std::string attention = element(html, "<section class=\"panel\" id=\"attention\"");
  EXPECT_EQ(count_of(attention, "<figure>"), 3u);
  EXPECT_EQ(data_configs(attention, "<g class=\"series\"").size(), 9u);  // 3 charts x 3 quantized configurations
  EXPECT_EQ(count_of(attention, "<circle class=\"marker\""), 45u);    // x 5 layers

  const std::string needles = element(html, "<section class=\"panel\" id=\"needles\"");
  EXPECT_EQ(data_configs(needles, "<g class=\"heatmap\""),
            (std::vector<std::string>{"fp16", "kvquant-2bit", "kivi-2bit", "rtn-2bit"}));
  EXPECT_EQ(count_of(needles, "<rect class=\"cell\""), 60u);  // 4 x 3 contexts x 5 depths
  // kivi at 1024 tokens and depth 50%: 1 of 4 probes, the number in the cell.
  EXPECT_NE(needles.find("kivi-2bit: depth 50%, context 1024: 1/4 correct"), std::string::npos);
  EXPECT_NE(needles.find(">25</text>"), std::string::npos);
  for (const char* label : {">256</text>", ">512</text>", ">1k</text>", ">0%</text>", ">100%</text>"}) {
    EXPECT_NE(needles.find(label), std::string::npos) << label;
  }
  const std::string tasks = element(html, "<section class=\"panel\" id=\"tasks\"");
  EXPECT_EQ(count_of(tasks, "<tr>"), 1u + 4u);  // header; kivi: capital; rtn: capital, 2, color
}

TEST(EvaluationReport, EscapesEveryText) {
  Evaluation e = testing::sample_evaluation();
  e.model = "<script>alert(1)</script>";
  e.command_line = "kvforge eval --gate 'ppl<=1.03*fp16' && rm -rf \"x\"";
  e.configurations[2].name = "kivi<b>&'\"";
  e.configurations[3].tasks[0].answer = "</td></tr></table><img src=x onerror=alert(1)>";
  const std::string html = render_evaluation_report(e);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<b>"), std::string::npos);
  EXPECT_EQ(html.find("<img"), std::string::npos);
  EXPECT_NE(html.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);
  EXPECT_NE(html.find("kivi&lt;b&gt;&amp;&#39;&quot;"), std::string::npos);
  EXPECT_NE(html.find("&amp;&amp; rm -rf &quot;x&quot;"), std::string::npos);
  EXPECT_EQ(tag_balance_error(html), "");
  EXPECT_EQ(html_escaped("a\x01z\tb\n"), "a\xEF\xBF\xBDz\tb\n");
}

TEST(EvaluationReport, IsWellFormedSelfContainedAndDeterministic) {
  const Evaluation e = testing::sample_evaluation();
  const std::string html = render_evaluation_report(e);
  EXPECT_EQ(tag_balance_error(html), "");
  EXPECT_EQ(html, render_evaluation_report(e));
  // Nothing to fetch: no script, no external sheet, image or font. The only
  // URL is SVG's namespace name, which is never fetched.
  for (const char* fetch : {"<script", "<link", "src=", "@import", "url(http", "<iframe"}) {
    EXPECT_EQ(html.find(fetch), std::string::npos) << fetch;
  }
  EXPECT_EQ(count_of(html, "http"), count_of(html, "xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_EQ(count_of(html, "<style>"), 1u);
}

TEST(EvaluationReport, SectionsWhoseMeasurementWasNotRunSaySo) {
  Evaluation e = testing::sample_evaluation();
  for (ConfigurationEvaluation& c : e.configurations) {
    c.needles.clear();
    c.tasks.clear();
    c.attention.clear();
  }
  const std::string html = render_evaluation_report(e);
  EXPECT_NE(html.find("No needle probes were run."), std::string::npos);
  EXPECT_NE(html.find("No tasks were evaluated."), std::string::npos);
  EXPECT_NE(html.find("No attention errors were measured"), std::string::npos);
  EXPECT_EQ(count_of(element(html, "<section class=\"panel\" id=\"frontier\""), "<figure>"), 2u);  // ppl and KL
  EXPECT_EQ(tag_balance_error(html), "");
  e.configurations.clear();
  EXPECT_EQ(tag_balance_error(render_evaluation_report(e)), "");
}

TEST(EvaluationReport, WritesThroughATemporaryFileAndLeavesNothingOnFailure) {
  const fs::path dir = testing::scratch_dir("evaluation-report-write");
  const Evaluation e = testing::sample_evaluation();
  write_evaluation_report(e, dir / "report.html");
  EXPECT_EQ(testing::read_file(dir / "report.html"), render_evaluation_report(e));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);

  EXPECT_THROW(write_evaluation_report(e, dir / "absent" / "report.html"), InputError);
  fs::create_directory(dir / "taken");  // a directory where the file should go: the rename fails
  try {
    write_evaluation_report(e, dir / "taken");
    FAIL() << "wrote over a directory";
  } catch (const InputError& error) {
    EXPECT_EQ(std::string(error.what()).rfind((dir / "taken").string() + ": a writable path for the HTML report", 0), 0u);
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);  // report.html and taken/
  fs::remove_all(dir);
}

// --- headless Chromium -------------------------------------------------------

bool chromium_installed() { return std::system("command -v chromium >/dev/null 2>&1") == 0; }

nlohmann::json screenshot_facts(const fs::path& png, const std::vector<std::string>& colors) {
  const fs::path out = png.parent_path() / "facts.json";
  std::string command = "python3 '" + (testing::fixtures_dir().parent_path() / "check_report_screenshot.py").string() +
                        "' '" + png.string() + "'";
  for (const std::string& color : colors) command += " '" + color + "'";
  if (std::system((command + " >'" + out.string() + "'").c_str()) != 0) return nullptr;
  return nlohmann::json::parse(testing::read_file(out));
}

int64_t pixels_between(const nlohmann::json& color, int64_t y_begin, int64_t y_end) {
  int64_t count = 0;
  for (const auto& [band, pixels] : color.at("bands").items()) {
    const int64_t y = std::stoll(band) * 50;
    if (y >= y_begin && y + 50 <= y_end) count += pixels.get<int64_t>();
  }
  return count;
}

TEST(EvaluationReport, RendersInHeadlessChromiumWithTheTableAndTheCharts) {
  if (!chromium_installed()) {
    if (testing::running_under_ci()) FAIL() << "CI is set and chromium is not installed (scripts/setup.sh installs it)";
    GTEST_SKIP() << "chromium is not installed (apt-get install chromium): the report is not rendered";
  }
  const fs::path dir = testing::scratch_dir("evaluation-report-chromium");
  write_evaluation_report(testing::sample_evaluation(), dir / "report.html");
  const fs::path png = dir / "report.png";
  const std::string command = "chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run "
                              "--user-data-dir='" + (dir / "profile").string() + "' --screenshot='" + png.string() +
                              "' --window-size=1400,3000 'file://" + (dir / "report.html").string() + "' >'" +
                              (dir / "chromium.log").string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << testing::read_file(dir / "chromium.log");
  ASSERT_TRUE(fs::exists(png)) << testing::read_file(dir / "chromium.log");
  fs::remove_all(dir / "profile");  // megabytes of browser state; the page and its screenshot stay for a person to see
  std::cout << "screenshot: " << png.string() << "\n";

  // Colours the page paints flat (CSS and the report's palette): the
  // masthead, the table's header row, the chart plot areas, the three
  // quantized configurations' colours, and the heatmap's 100% and 0% ends.
  const std::string masthead = "#111827", table_header = "#e8edf4", plot_area = "#fbfcfe", kvquant = "#4e79a7",
                    kivi = "#f28e2b", rtn = "#e15759", full = "#1a9850", none = "#d73027";
  const nlohmann::json facts = screenshot_facts(png, {masthead, table_header, plot_area, kvquant, kivi, rtn, full, none});
  ASSERT_FALSE(facts.is_null()) << "the screenshot could not be decoded";
  EXPECT_EQ(facts.at("width"), 1400);
  EXPECT_EQ(facts.at("height"), 3000);
  // Not blank: anti-aliased text and charts give hundreds of colours, and
  // most rows of the page hold more than one.
  EXPECT_GT(facts.at("distinct_colors").get<int>(), 200);
  EXPECT_GT(facts.at("busy_rows").get<int>(), 1500);

  const auto& colors = facts.at("colors");
  auto y_min = [&](const std::string& c) { return colors.at(c).at("y_min").get<int64_t>(); };
  auto y_max = [&](const std::string& c) { return colors.at(c).at("y_max").get<int64_t>(); };
  for (const std::string& c : {masthead, table_header, plot_area, kvquant, kivi, rtn, full, none}) {
    ASSERT_GT(colors.at(c).at("count").get<int64_t>(), 0) << c << " is not on the page";
  }
  // The masthead is the top of the page, full width: the 50-row bands it
  // fills (text aside) from row 0 on.
  EXPECT_EQ(y_min(masthead), 0);
  int64_t masthead_end = 0;
  while (pixels_between(colors.at(masthead), masthead_end, masthead_end + 50) > 1400 * 50 * 8 / 10) masthead_end += 50;
  EXPECT_GE(masthead_end, 150);
  // The comparison table's header row (about 1200 x 30 pixels; the flipped
  // tasks' table at the bottom has one too) comes below it ...
  EXPECT_GT(y_min(table_header), masthead_end);
  EXPECT_GT(colors.at(table_header).at("count").get<int64_t>(), 1000 * 25);
  // ... then the chart plot areas (six charts of at least 300 x 180) ...
  EXPECT_GT(y_min(plot_area), y_min(table_header) + 150);
  EXPECT_GT(colors.at(plot_area).at("count").get<int64_t>(), 6 * 300 * 180 / 2);
  // ... where every quantized configuration is drawn (points and lines,
  // not only the table's swatch) ...
  for (const std::string& c : {kvquant, kivi, rtn}) {
    EXPECT_GT(pixels_between(colors.at(c), (y_min(plot_area) / 50) * 50 + 50, y_max(plot_area) / 50 * 50), 150)
        << c << " is missing from the charts";
  }
  // ... then the heatmaps: fp16's 15 cells are all 100% (at least 40 x 18
  // pixels each around the number), and rtn has cells at 0%.
  EXPECT_GT(y_min(full), y_max(plot_area));
  EXPECT_GT(colors.at(full).at("count").get<int64_t>(), 15 * 40 * 18);
  EXPECT_GT(y_min(none), y_max(plot_area));
}

}  // namespace
}  // namespace kvforge
