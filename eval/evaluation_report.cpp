#include "eval/evaluation_report.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "eval/evaluation_json.h"
#include "eval/evaluation_table.h"
#include "eval/svg_chart.h"
#include "formats/input_error.h"
#include "formats/atomic_text_file.h"
#include "kvforge/version.h"

namespace kvforge {
namespace {

using namespace svg;

std::string swatch(const std::string& color) { return "<span class=\"swatch\" style=\"background:" + color + "\"></span>"; }

// --- sections ----------------------------------------------------------------

std::string empty_note(const std::string& text) { return "<p class=\"empty\">" + html_escaped(text) + "</p>"; }

std::string legend(const Evaluation& evaluation, bool include_reference) {
  std::string html = "<div class=\"legend\">";
  for (std::size_t i = include_reference ? 0 : 1; i < evaluation.configurations.size(); ++i) {
    html += "<span>" + swatch(configuration_color(i)) + html_escaped(evaluation.configurations[i].name) + "</span>";
  }
  return html + "</div>";
}

std::string header_section(const Evaluation& evaluation) {
  const auto item = [](const std::string& term, const std::string& value) {
    return "<div><dt>" + html_escaped(term) + "</dt><dd>" + html_escaped(value.empty() ? "not recorded" : value) +
           "</dd></div>";
  };
  std::string html = "<header class=\"masthead\" id=\"header\"><div class=\"wrap\"><div class=\"brand\">kvforge eval</div>";
  html += "<h1>KV-cache quality report</h1><dl class=\"meta\">";
  html += item("model", evaluation.model);
  html += item("artifact", evaluation.artifact.empty() ? "none (16-bit cache only)" : evaluation.artifact);
  html += item("held-out data", evaluation.data);
  html += item("device", evaluation.device);
  html += item("date", evaluation.date);
  html += item("windows", std::to_string(evaluation.context) + " tokens, prefill chunks of " +
                              std::to_string(evaluation.chunk));
  html += "</dl><div class=\"command\"><span class=\"prompt\">$ </span>" + html_escaped(evaluation.command_line) +
          "</div></div></header>";
  return html;
}

std::string comparison_section(const Evaluation& evaluation) {
  const ComparisonTable table = comparison_table(evaluation);
  std::string html =
      "<section class=\"panel\" id=\"comparison\"><h2>Comparison</h2><p class=\"lede\">Every configuration on the same "
      "tokens, windows and probes; the 16-bit cache is the reference.</p><div class=\"table-scroll\"><table class=\"data\">"
      "<thead><tr>";
  std::optional<std::size_t> needle_column;
  for (std::size_t c = 0; c < table.columns.size(); ++c) {
    if (table.columns[c].header == "needle") needle_column = c;
    html += std::string("<th") + (table.columns[c].numeric ? "" : " class=\"text\"") + ">" +
            html_escaped(table.columns[c].header) + "</th>";
  }
  html += "</tr></thead><tbody>";
  for (std::size_t r = 0; r < table.rows.size(); ++r) {
    const ConfigurationEvaluation& configuration = evaluation.configurations[r];
    html += r == 0 ? "<tr class=\"reference\">" : "<tr>";
    for (std::size_t c = 0; c < table.columns.size(); ++c) {
      std::string cell = html_escaped(table.rows[r][c]);
      std::string attributes = table.columns[c].numeric ? "" : " class=\"text\"";
      if (c == 0) cell = swatch(configuration_color(r)) + cell + (r == 0 ? "<span class=\"tag\">reference</span>" : "");
      if (needle_column == c && !configuration.needles.empty()) {
        // The heatmap's colour, paled so that the number stays the figure.
        const Rgb strong = accuracy_rgb(configuration.needle_accuracy());
        const Rgb tint{255 - 0.45 * (255 - strong.r), 255 - 0.45 * (255 - strong.g), 255 - 0.45 * (255 - strong.b)};
        attributes += " style=\"background:" + hex(tint) + ";color:" + text_color_on(tint) + "\"";
      }
      html += "<td" + attributes + ">" + cell + "</td>";
    }
    html += "</tr>";
  }
  html +=
      "</tbody></table></div><p class=\"note\"><strong>eff.bits</strong>: bits per cached element including scales, offsets, "
      "outliers and the exact sink and residual tokens. <strong>ppl vs fp16</strong>: relative change of perplexity. "
      "<strong>KL</strong>: KL(P<sub>fp16</sub> &#8214; P<sub>config</sub>) of the next-token distributions, nats. "
      "<strong>top-1</strong>: positions whose most likely token is fp16's. <strong>needle</strong>: needle probes answered. "
      "<strong>tasks</strong>: tasks whose answer contains the expected one. <strong>attn error</strong>: mean over layers of the "
      "key- and value-induced relative attention-output errors.</p></section>";
  return html;
}

std::string frontier_section(const Evaluation& evaluation) {
  std::vector<ChartPoint> perplexity, kl, needle;
  for (std::size_t i = 0; i < evaluation.configurations.size(); ++i) {
    const ConfigurationEvaluation& c = evaluation.configurations[i];
    if (!std::isfinite(c.effective_bits) || c.effective_bits <= 0) continue;
    if (c.perplexity && std::isfinite(c.perplexity->perplexity) && c.perplexity->perplexity > 0) {
      perplexity.push_back({c.name, configuration_color(i), c.effective_bits, c.perplexity->perplexity});
    }
    if (c.perplexity && std::isfinite(c.perplexity->kl_mean)) {
      kl.push_back({c.name, configuration_color(i), c.effective_bits, c.perplexity->kl_mean});
    }
    if (!c.needles.empty()) needle.push_back({c.name, configuration_color(i), c.effective_bits, c.needle_accuracy()});
  }
  std::string html =
      "<section class=\"panel\" id=\"frontier\"><h2>Quality against effective bits</h2><p class=\"lede\">Every "
      "configuration is a point; the dashed line joins the Pareto frontier (no other configuration is both smaller "
      "and better).</p>" +
      legend(evaluation, true) + "<div class=\"charts\">";
  const auto values = [](const std::vector<ChartPoint>& points) {
    std::vector<double> ys;
    for (const ChartPoint& p : points) ys.push_back(p.y);
    return ys;
  };
  if (!perplexity.empty()) {
    html += frontier_chart("Perplexity", "perplexity", perplexity, false, value_scale(values(perplexity), false),
                           [](double v) { return compact(v); });
  }
  if (!kl.empty()) {
    const std::vector<double> kl_values = values(kl);
    html += frontier_chart("KL divergence from fp16 (mean)", "KL mean (nats)", kl, false,
                           linear_scale(0, *std::max_element(kl_values.begin(), kl_values.end()), true),
                           [](double v) { return compact(v); });
  }
  if (!needle.empty()) {
    const Scale ys{0, 1.06, false, {0, 0.25, 0.5, 0.75, 1}};
    html += frontier_chart("Needle accuracy", "needle accuracy", needle, true, ys,
                           [](double v) { return percent_text(v); });
  }
  html += "</div>";
  if (perplexity.empty() && needle.empty()) html += empty_note("Neither perplexity nor needle probes were measured.");
  return html + "</section>";
}

std::string attention_section(const Evaluation& evaluation) {
  std::vector<Series> key_kl, key_output, value_output;
  for (std::size_t i = 1; i < evaluation.configurations.size(); ++i) {
    const ConfigurationEvaluation& c = evaluation.configurations[i];
    if (c.attention.empty()) continue;
    Series kl{c.name, configuration_color(i), {}}, key{kl}, value{kl};
    for (const LayerAttentionError& layer : c.attention) {
      const double x = static_cast<double>(layer.layer);
      kl.points.emplace_back(x, layer.key_kl);
      key.points.emplace_back(x, layer.key_output);
      value.points.emplace_back(x, layer.value_output);
    }
    key_kl.push_back(std::move(kl));
    key_output.push_back(std::move(key));
    value_output.push_back(std::move(value));
  }
  std::string html =
      "<section class=\"panel\" id=\"attention\"><h2>Attention-output error per layer</h2><p class=\"lede\">Post-W<sub>O"
      "</sub> attention output on held-out captures, averaged over KV heads: the error that quantized keys cause "
      "(with exact values) and the error that quantized values cause (with exact keys).</p>";
  if (key_output.empty()) return html + empty_note("No attention errors were measured (they need held-out captures).") + "</section>";
  html += legend(evaluation, false) + "<div class=\"charts\">";
  html += layer_chart("Key-induced output error", "relative error", key_output);
  html += layer_chart("Value-induced output error", "relative error", value_output);
  html += layer_chart("Key-induced attention KL", "KL (nats)", key_kl);
  return html + "</div></section>";
}

std::string context_text(int64_t context) {
  if (context >= 1024 && context % 1024 == 0) return std::to_string(context / 1024) + "k";
  return std::to_string(context);
}

constexpr double kCellWidth = 50, kCellHeight = 24, kLeft = 58, kTop = 4, kBottom = 40;

double heatmap_width(std::size_t contexts) { return kLeft + kCellWidth * static_cast<double>(contexts) + 6; }

// One configuration's grid: depth down, context across, each cell coloured
// by accuracy and labelled with it.
std::string needle_heatmap(const ConfigurationEvaluation& c, const std::string& color) {
  std::map<std::pair<double, int64_t>, std::pair<int64_t, int64_t>> cells;  // (depth, context) -> (correct, probes)
  std::vector<int64_t> contexts;
  std::vector<double> depths;
  for (const NeedleCell& cell : c.needles) {
    auto& [correct, probes] = cells[{cell.depth, cell.context}];
    correct += cell.correct;
    probes += cell.probes;
    contexts.push_back(cell.context);
    depths.push_back(cell.depth);
  }
  std::sort(contexts.begin(), contexts.end());
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());

  const double width = heatmap_width(contexts.size());
  const double height = kTop + kCellHeight * static_cast<double>(depths.size()) + kBottom;
  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + coordinate(width) + "\" height=\"" +
                    coordinate(height) + "\" viewBox=\"0 0 " + coordinate(width) + " " + coordinate(height) +
                    "\" role=\"img\" aria-label=\"" + html_escaped("needle accuracy of " + c.name) + "\">";
  svg += "<g class=\"heatmap\" data-config=\"" + html_escaped(c.name) + "\">";
  for (std::size_t row = 0; row < depths.size(); ++row) {
    const double y = kTop + kCellHeight * static_cast<double>(row);
    svg += "<text class=\"tick\" x=\"" + coordinate(kLeft - 6) + "\" y=\"" + coordinate(y + kCellHeight / 2) +
           "\" text-anchor=\"end\" dominant-baseline=\"middle\">" + percent_text(depths[row]) + "</text>";
    for (std::size_t column = 0; column < contexts.size(); ++column) {
      const double x = kLeft + kCellWidth * static_cast<double>(column);
      const auto found = cells.find({depths[row], contexts[column]});
      const bool probed = found != cells.end() && found->second.second > 0;
      const double accuracy =
          probed ? static_cast<double>(found->second.first) / static_cast<double>(found->second.second) : 0;
      const Rgb fill = probed ? accuracy_rgb(accuracy) : Rgb{229, 231, 235};
      const std::string tooltip =
          probed ? c.name + ": depth " + percent_text(depths[row]) + ", context " + std::to_string(contexts[column]) +
                       ": " + std::to_string(found->second.first) + "/" + std::to_string(found->second.second) +
                       " correct"
                 : c.name + ": not probed";
      svg += "<rect class=\"cell\" x=\"" + coordinate(x) + "\" y=\"" + coordinate(y) + "\" width=\"" +
             coordinate(kCellWidth - 2) + "\" height=\"" + coordinate(kCellHeight - 2) + "\" rx=\"2\" fill=\"" +
             hex(fill) + "\"><title>" + html_escaped(tooltip) + "</title></rect>";
      svg += "<text class=\"cell-value\" x=\"" + coordinate(x + kCellWidth / 2 - 1) + "\" y=\"" +
             coordinate(y + kCellHeight / 2) + "\" fill=\"" + text_color_on(fill) +
             "\" text-anchor=\"middle\" dominant-baseline=\"central\">" +
             (probed ? printed("%.0f", 100 * accuracy) : std::string("&#8211;")) + "</text>";
    }
  }
  const double grid_bottom = kTop + kCellHeight * static_cast<double>(depths.size());
  for (std::size_t column = 0; column < contexts.size(); ++column) {
    svg += "<text class=\"tick\" x=\"" + coordinate(kLeft + kCellWidth * (static_cast<double>(column) + 0.5) - 1) +
           "\" y=\"" + coordinate(grid_bottom + 14) + "\" text-anchor=\"middle\">" + context_text(contexts[column]) +
           "</text>";
  }
  svg += "<text class=\"axis-label\" x=\"" + coordinate(kLeft + kCellWidth * static_cast<double>(contexts.size()) / 2) +
         "\" y=\"" + coordinate(grid_bottom + 32) + "\" text-anchor=\"middle\">context (tokens)</text>";
  svg += "<text class=\"axis-label\" transform=\"translate(12 " + coordinate(kTop + (grid_bottom - kTop) / 2) +
         ") rotate(-90)\" text-anchor=\"middle\">depth</text></g></svg>";

  int64_t correct = 0, probes = 0;
  for (const NeedleCell& cell : c.needles) {
    correct += cell.correct;
    probes += cell.probes;
  }
  return "<figure class=\"heatmap-card\"><figcaption>" + swatch(color) + html_escaped(c.name) +
         "<span class=\"muted\"> &#183; " + percent_text(c.needle_accuracy()) + " (" + std::to_string(correct) + "/" +
         std::to_string(probes) + ")</span></figcaption>" + svg + "</figure>";
}

std::string accuracy_scale_legend() {
  std::string svg =
      "<svg class=\"scale\" xmlns=\"http://www.w3.org/2000/svg\" width=\"320\" height=\"34\" viewBox=\"0 0 320 34\" "
      "role=\"img\" aria-label=\"accuracy colour scale\"><defs><linearGradient id=\"accuracy-scale\">";
  for (const double stop : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    svg += "<stop offset=\"" + printed("%.2f", stop) + "\" stop-color=\"" + hex(accuracy_rgb(stop)) + "\"/>";
  }
  svg += "</linearGradient></defs><rect x=\"20\" y=\"2\" width=\"280\" height=\"12\" rx=\"2\" fill=\"url(#accuracy-scale)\"/>";
  for (const double stop : {0.0, 0.5, 1.0}) {
    svg += "<text class=\"tick\" x=\"" + coordinate(20 + 280 * stop) + "\" y=\"30\" text-anchor=\"middle\">" +
           percent_text(stop) + "</text>";
  }
  return svg + "</svg>";
}

std::string needles_section(const Evaluation& evaluation) {
  std::string html =
      "<section class=\"panel\" id=\"needles\"><h2>Needle-in-a-haystack accuracy</h2><p class=\"lede\">Facts placed at a "
      "depth of the context (0% = its start), answered by greedy decoding through each cache; each cell is the "
      "percentage of its probes answered correctly.</p>";
  const bool measured = std::any_of(evaluation.configurations.begin(), evaluation.configurations.end(),
                                    [](const ConfigurationEvaluation& c) { return !c.needles.empty(); });
  if (!measured) return html + empty_note("No needle probes were run.") + "</section>";
  // Columns as wide as the widest grid and its card's padding, as many as fit.
  std::size_t widest = 0;
  for (const ConfigurationEvaluation& c : evaluation.configurations) {
    std::vector<int64_t> contexts;
    for (const NeedleCell& cell : c.needles) contexts.push_back(cell.context);
    std::sort(contexts.begin(), contexts.end());
    widest = std::max(widest, static_cast<std::size_t>(std::unique(contexts.begin(), contexts.end()) - contexts.begin()));
  }
  const double column = std::max(260.0, heatmap_width(widest) + 32);
  html += "<div class=\"scale-row\"><span class=\"muted\">accuracy</span>" + accuracy_scale_legend() +
          "</div><div class=\"heatmaps\" style=\"grid-template-columns:repeat(auto-fill,minmax(" +
          printed("%.0f", column) + "px,1fr))\">";
  for (std::size_t i = 0; i < evaluation.configurations.size(); ++i) {
    const ConfigurationEvaluation& c = evaluation.configurations[i];
    if (!c.needles.empty()) html += needle_heatmap(c, configuration_color(i));
  }
  return html + "</div></section>";
}

std::string answer_cell(const TaskAnswer& answer) {
  constexpr std::size_t kMaxBytes = 160;
  std::string text = answer.answer;
  if (text.size() > kMaxBytes) {
    std::size_t cut = kMaxBytes;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // whole UTF-8 characters
    text = text.substr(0, cut) + "\u2026";
  }
  return "<td class=\"text\"><span class=\"answer\">" + html_escaped(text) + "</span> <span class=\"match\">" +
         html_escaped(match_label(answer)) + "</span></td>";
}

std::string tasks_section(const Evaluation& evaluation) {
  std::string html =
      "<section class=\"panel\" id=\"tasks\"><h2>Tasks that flipped against fp16</h2><p class=\"lede\">The user's tasks "
      "(--tasks) whose exact or contains match through a configuration differs from the 16-bit cache's on the same "
      "input.</p>";
  const bool measured = std::any_of(evaluation.configurations.begin(), evaluation.configurations.end(),
                                    [](const ConfigurationEvaluation& c) { return !c.tasks.empty(); });
  if (!measured) return html + empty_note("No tasks were evaluated.") + "</section>";
  const std::vector<FlippedTask> flips = flipped_tasks(evaluation);
  if (flips.empty()) return html + empty_note("No task flipped.") + "</section>";
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < evaluation.configurations.size(); ++i) index[evaluation.configurations[i].name] = i;
  html +=
      "<table class=\"data\"><thead><tr><th class=\"text\">config</th><th class=\"text\">task</th><th "
      "class=\"text\">change</th><th class=\"text\">fp16 answer</th><th class=\"text\">answer</th></tr></thead><tbody>";
  for (const FlippedTask& flip : flips) {
    const std::string change = flip.change();
    html += "<tr><td class=\"text\">" + swatch(configuration_color(index[flip.configuration])) +
            html_escaped(flip.configuration) + "</td><td class=\"text\">" + html_escaped(flip.id) +
            "</td><td class=\"text\"><span class=\"badge badge-" + change + "\">" + change + "</span></td>" +
            answer_cell(flip.full_precision_answer) + answer_cell(flip.configuration_answer) + "</tr>";
  }
  return html + "</tbody></table></section>";
}

constexpr const char* kStyle = R"css(
:root{--ink:#1f2937;--muted:#6b7280;--line:#e5e7eb;--page:#f3f4f6}
*{box-sizing:border-box}
body{margin:0;background:var(--page);color:var(--ink);font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,"Liberation Sans","DejaVu Sans",sans-serif}
.wrap{max-width:1320px;margin:0 auto;padding:0 28px}
.masthead{background:#111827;color:#f9fafb;padding:26px 0 24px}
.brand{font-size:12px;letter-spacing:.14em;text-transform:uppercase;color:#93c5fd;font-weight:700}
h1{margin:4px 0 18px;font-size:26px;font-weight:650}
.meta{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:12px 32px;margin:0}
.meta dt{font-size:11px;text-transform:uppercase;letter-spacing:.08em;color:#9ca3af}
.meta dd{margin:2px 0 0;font:13px/1.4 ui-monospace,"DejaVu Sans Mono","Liberation Mono",monospace;color:#f3f4f6;overflow-wrap:anywhere}
.command{margin-top:18px;background:#1f2937;border:1px solid #374151;border-radius:6px;padding:10px 12px;font:12.5px/1.5 ui-monospace,"DejaVu Sans Mono","Liberation Mono",monospace;color:#e5e7eb;white-space:pre-wrap;overflow-wrap:anywhere}
.command .prompt{color:#6b7280}
.panel{background:#fff;border:1px solid var(--line);border-radius:10px;padding:20px 24px 22px;margin:22px 0;box-shadow:0 1px 2px rgba(0,0,0,.05)}
h2{font-size:17px;margin:0 0 4px}
.lede{color:var(--muted);margin:0 0 16px;font-size:13px}
.note{color:var(--muted);font-size:12px;margin:12px 0 0}
table.data{border-collapse:collapse;width:100%;font-size:13px;font-variant-numeric:tabular-nums}
table.data th{background:#e8edf4;color:#374151;font-weight:600;text-align:right;padding:8px 7px;border-bottom:1px solid #cbd5e1;white-space:nowrap}
table.data td{text-align:right;padding:7px 7px;border-bottom:1px solid var(--line);white-space:nowrap}
table.data .text{text-align:left}
table.data tr.reference td{background:#f8fafc;font-weight:600}
#tasks table.data td{white-space:normal}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:8px}
.tag{font-size:10px;font-weight:600;text-transform:uppercase;letter-spacing:.06em;color:#6b7280;border:1px solid #d1d5db;border-radius:8px;padding:0 6px;margin-left:8px}
.legend{display:flex;flex-wrap:wrap;gap:6px 20px;margin:0 0 12px;font-size:12.5px}
.charts{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:20px}
figure{margin:0}
figcaption{font-weight:600;font-size:13px;margin-bottom:6px}
svg{display:block;max-width:100%;height:auto}
svg text{font-family:inherit}
.plot-area{fill:#fbfcfe;stroke:#e5e7eb}
.grid{stroke:#e9edf2;stroke-width:1}
.axis{stroke:#9ca3af;stroke-width:1}
.tick{fill:#6b7280;font-size:11px}
.axis-label{fill:#374151;font-size:12px}
.point{stroke:#fff;stroke-width:1.5}
.point-label{font-size:11px;fill:#111827;paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}
.leader{stroke:#9ca3af;stroke-width:.75}
.frontier{fill:none;stroke:#94a3b8;stroke-width:1.5;stroke-dasharray:5 4}
.series-line{fill:none;stroke-width:2}
.marker{stroke:#fff;stroke-width:1}
.scale-row{display:flex;align-items:center;gap:10px;margin:0 0 10px;font-size:12px}
.table-scroll{overflow-x:auto}
.heatmaps{display:grid;gap:16px}
.heatmap-card{border:1px solid var(--line);border-radius:8px;padding:12px 14px}
.cell-value{font-size:11px;font-weight:600}
.muted{color:var(--muted);font-weight:400}
.empty{color:var(--muted);font-style:italic;margin:0}
.answer{font:12.5px ui-monospace,"DejaVu Sans Mono","Liberation Mono",monospace;white-space:pre-wrap;overflow-wrap:anywhere}
.match{color:var(--muted);font-size:11.5px;margin-left:6px}
.badge{border-radius:4px;padding:1px 7px;font-weight:600;font-size:12px}
.badge-lost{color:#b91c1c;background:#fee2e2}
.badge-gained{color:#15803d;background:#dcfce7}
.badge-changed{color:#92400e;background:#fef3c7}
footer{color:var(--muted);font-size:12px;padding:2px 0 30px}
)css";

}  // namespace

std::string html_escaped(std::string_view text) {
  std::string escaped;
  escaped.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        escaped += "&amp;";
        break;
      case '<':
        escaped += "&lt;";
        break;
      case '>':
        escaped += "&gt;";
        break;
      case '"':
        escaped += "&quot;";
        break;
      case '\'':
        escaped += "&#39;";
        break;
      default:
        if ((static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') || c == 0x7F) {
          escaped += "\uFFFD";
        } else {
          escaped += c;
        }
    }
  }
  return escaped;
}

std::string render_evaluation_report(const Evaluation& evaluation) {
  const std::string title =
      "kvforge eval: " + (evaluation.model.empty() ? std::string("evaluation") : evaluation.model);
  std::string html = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" "
                     "content=\"width=device-width, initial-scale=1\"><title>" +
                     html_escaped(title) + "</title><style>" + kStyle + "</style></head><body>";
  html += header_section(evaluation);
  html += "<main class=\"wrap\">";
  if (evaluation.configurations.empty()) {
    html += "<section class=\"panel\" id=\"comparison\"><h2>Comparison</h2>" +
            empty_note("No configuration was evaluated.") + "</section>";
  } else {
    html += comparison_section(evaluation);
    html += frontier_section(evaluation);
    html += attention_section(evaluation);
    html += needles_section(evaluation);
    html += tasks_section(evaluation);
  }
  html += "<footer>Generated by kvforge " + std::string(kVersion) + " from an evaluation of schema " +
          std::to_string(kEvaluationJsonSchema) +
          " (kvforge eval --json). Self-contained: no scripts, nothing loaded from the network.</footer></main></body></html>\n";
  return html;
}

void write_evaluation_report(const Evaluation& evaluation, const std::filesystem::path& path) {
  write_text_file_atomically(path, render_evaluation_report(evaluation), "the HTML report");
}

}  // namespace kvforge
