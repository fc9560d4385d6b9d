#include "eval/evaluation_report.h"

#include <unistd.h>

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
#include "formats/input_error.h"
#include "formats/remove_on_failure.h"
#include "kvforge/version.h"

namespace kvforge {
namespace {

// --- text and colours ------------------------------------------------------

std::string printed(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

// Tick and tooltip numbers: 4 significant digits, no trailing zeros.
std::string compact(double value) { return printed("%.4g", value); }

std::string percent_text(double share) { return printed("%.0f", 100 * share) + "%"; }

// The 16-bit reference is drawn in near-black; the others take Tableau's
// twenty categorical colours (ten strong, then their light partners) in the
// evaluation's order.
std::string configuration_color(std::size_t index) {
  static constexpr std::array<const char*, 20> kPalette = {
      "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
      "#a0cbe8", "#ffbe7d", "#8cd17d", "#b6992d", "#86bcb6", "#d37295", "#f1ce63", "#d4a6c8", "#79706e", "#fabfd2"};
  return index == 0 ? "#1f2937" : kPalette[(index - 1) % kPalette.size()];
}

struct Rgb {
  double r, g, b;
};

std::string hex(const Rgb& c) {
  char buffer[8];
  auto byte = [](double v) { return static_cast<int>(std::lround(std::clamp(v, 0.0, 255.0))); };
  std::snprintf(buffer, sizeof buffer, "#%02x%02x%02x", byte(c.r), byte(c.g), byte(c.b));
  return buffer;
}

// Accuracy 0..1 on ColorBrewer's RdYlGn ends and middle, linear in RGB
// between them: red (0), yellow (0.5), green (1).
Rgb accuracy_rgb(double accuracy) {
  constexpr Rgb kLow{215, 48, 39}, kMiddle{254, 224, 139}, kHigh{26, 152, 80};
  const double a = std::clamp(std::isfinite(accuracy) ? accuracy : 0.0, 0.0, 1.0);
  const auto mix = [](const Rgb& x, const Rgb& y, double t) {
    return Rgb{x.r + (y.r - x.r) * t, x.g + (y.g - x.g) * t, x.b + (y.b - x.b) * t};
  };
  return a < 0.5 ? mix(kLow, kMiddle, a / 0.5) : mix(kMiddle, kHigh, (a - 0.5) / 0.5);
}

// Dark text on light cells, white on dark (relative luminance, sRGB weights).
std::string text_color_on(const Rgb& c) {
  const double luminance = (0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b) / 255;
  return luminance > 0.55 ? "#1f2937" : "#ffffff";
}

std::string swatch(const std::string& color) { return "<span class=\"swatch\" style=\"background:" + color + "\"></span>"; }

// --- scales ------------------------------------------------------------------

// A value range mapped onto a pixel range, linear or logarithmic (any base:
// only ratios matter), with the values that get a tick and a grid line.
struct Scale {
  double lo = 0, hi = 1;
  bool logarithmic = false;
  std::vector<double> ticks;

  double fraction(double value) const {
    if (logarithmic) return std::log(value / lo) / std::log(hi / lo);
    return (value - lo) / (hi - lo);
  }
};

// 1, 2, 2.5 or 5 times a power of ten, the smallest not below `raw`.
double nice_step(double raw) {
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double multiple : {1.0, 2.0, 2.5, 5.0}) {
    if (raw <= multiple * power * (1 + 1e-9)) return multiple * power;
  }
  return 10 * power;
}

Scale linear_scale(double lo, double hi, bool from_zero) {
  if (from_zero) lo = std::min(lo, 0.0);
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= from_zero && lo == 0 ? 0 : pad;
    hi += pad;
  }
  const double margin = 0.04 * (hi - lo);
  if (!(from_zero && lo == 0)) lo -= margin;
  hi += margin;
  const double step = nice_step((hi - lo) / 5);
  Scale scale{std::floor(lo / step) * step, std::ceil(hi / step) * step, false, {}};
  for (double tick = scale.lo; tick <= scale.hi + step * 1e-6; tick += step) {
    scale.ticks.push_back(std::abs(tick) < step * 1e-9 ? 0 : tick);
  }
  return scale;
}

// Positive values spread over more than a decade: 1-2-5 ticks per decade
// (only powers of ten when that makes too many).
Scale log_scale(double lo, double hi) {
  Scale scale{lo / 1.25, hi * 1.25, true, {}};
  for (const bool only_powers : {false, true}) {
    scale.ticks.clear();
    for (int exponent = static_cast<int>(std::floor(std::log10(scale.lo)));
         exponent <= static_cast<int>(std::ceil(std::log10(scale.hi))); ++exponent) {
      for (const double multiple : {1.0, 2.0, 5.0}) {
        const double tick = multiple * std::pow(10.0, exponent);
        if ((!only_powers || multiple == 1.0) && tick >= scale.lo && tick <= scale.hi) scale.ticks.push_back(tick);
      }
    }
    if (scale.ticks.size() <= 9) break;
  }
  return scale;
}

// Effective bits on a log2 axis: 2, 3 and 4 bits get room next to 16.
Scale bits_scale(double lo, double hi) {
  Scale scale{lo / 1.2, hi * 1.2, true, {}};
  for (const double tick : {1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0}) {
    if (tick >= scale.lo && tick <= scale.hi) scale.ticks.push_back(tick);
  }
  return scale;
}

Scale value_scale(const std::vector<double>& values, bool from_zero) {
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  if (!from_zero && *lo > 0 && *hi / *lo > 8) return log_scale(*lo, *hi);
  return linear_scale(*lo, *hi, from_zero);
}

// --- charts --------------------------------------------------------------------

// An SVG chart's box: the plot area is inset by the margins.
struct Plot {
  double width, height, left, right, top, bottom;
  double x(const Scale& s, double v) const { return left + s.fraction(v) * (width - left - right); }
  double y(const Scale& s, double v) const { return height - bottom - s.fraction(v) * (height - top - bottom); }
};

std::string coordinate(double value) { return printed("%.1f", value); }

std::string svg_open(const Plot& plot, const std::string& label) {
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 " + coordinate(plot.width) + " " +
         coordinate(plot.height) + "\" role=\"img\" aria-label=\"" + html_escaped(label) + "\">";
}

using TickText = std::string (*)(double);

std::string plot_frame(const Plot& plot, const Scale& xs, const Scale& ys, const std::string& x_label,
                       const std::string& y_label, TickText x_tick, TickText y_tick) {
  const double x0 = plot.left, x1 = plot.width - plot.right, y0 = plot.height - plot.bottom, y1 = plot.top;
  std::string svg = "<rect class=\"plot-area\" x=\"" + coordinate(x0) + "\" y=\"" + coordinate(y1) + "\" width=\"" +
                    coordinate(x1 - x0) + "\" height=\"" + coordinate(y0 - y1) + "\"/>";
  for (const double tick : ys.ticks) {
    const std::string y = coordinate(plot.y(ys, tick));
    svg += "<line class=\"grid\" x1=\"" + coordinate(x0) + "\" x2=\"" + coordinate(x1) + "\" y1=\"" + y + "\" y2=\"" + y +
           "\"/><text class=\"tick\" x=\"" + coordinate(x0 - 6) + "\" y=\"" + y +
           "\" text-anchor=\"end\" dominant-baseline=\"middle\">" + html_escaped(y_tick(tick)) + "</text>";
  }
  for (const double tick : xs.ticks) {
    const std::string x = coordinate(plot.x(xs, tick));
    svg += "<line class=\"grid\" x1=\"" + x + "\" x2=\"" + x + "\" y1=\"" + coordinate(y1) + "\" y2=\"" + coordinate(y0) +
           "\"/><text class=\"tick\" x=\"" + x + "\" y=\"" + coordinate(y0 + 16) + "\" text-anchor=\"middle\">" +
           html_escaped(x_tick(tick)) + "</text>";
  }
  svg += "<line class=\"axis\" x1=\"" + coordinate(x0) + "\" x2=\"" + coordinate(x1) + "\" y1=\"" + coordinate(y0) +
         "\" y2=\"" + coordinate(y0) + "\"/><line class=\"axis\" x1=\"" + coordinate(x0) + "\" x2=\"" + coordinate(x0) +
         "\" y1=\"" + coordinate(y1) + "\" y2=\"" + coordinate(y0) + "\"/>";
  svg += "<text class=\"axis-label\" x=\"" + coordinate((x0 + x1) / 2) + "\" y=\"" + coordinate(plot.height - 6) +
         "\" text-anchor=\"middle\">" + html_escaped(x_label) + "</text>";
  svg += "<text class=\"axis-label\" transform=\"translate(14 " + coordinate((y0 + y1) / 2) +
         ") rotate(-90)\" text-anchor=\"middle\">" + html_escaped(y_label) + "</text>";
  return svg;
}

struct Box {
  double x0, y0, x1, y1;
  bool overlaps(const Box& other) const { return x0 < other.x1 && other.x0 < x1 && y0 < other.y1 && other.y0 < y1; }
};

// Where a point's label goes: the first spot around the point, nearest
// first (8 directions, then the same farther out), that overlaps no label
// placed before and no point, inside the plot; the first spot when none is
// free.
Box label_box(double px, double py, double text_width, const std::vector<Box>& taken, const Plot& plot) {
  constexpr double kHeight = 13, kGap = 8;
  constexpr std::array<std::pair<int, int>, 8> kDirections = {
      {{1, -1}, {1, 1}, {-1, -1}, {-1, 1}, {0, -1}, {0, 1}, {1, 0}, {-1, 0}}};
  std::optional<Box> first;
  for (const double distance : {0.0, 12.0, 24.0, 36.0, 48.0}) {
    for (const auto& [sx, sy] : kDirections) {
      const double x0 = sx > 0 ? px + kGap + distance : sx < 0 ? px - kGap - distance - text_width : px - text_width / 2;
      const double y0 = sy < 0 ? py - kGap - distance - kHeight + 4 : sy > 0 ? py + kGap + distance - 4 : py - kHeight / 2;
      const Box box{x0, y0, x0 + text_width, y0 + kHeight};
      if (!first) first = box;
      const bool inside = box.x0 >= plot.left + 2 && box.x1 <= plot.width - plot.right + 4 && box.y0 >= plot.top - 4 &&
                          box.y1 <= plot.height - plot.bottom;
      if (inside && std::none_of(taken.begin(), taken.end(), [&](const Box& other) { return box.overlaps(other); })) {
        return box;
      }
    }
  }
  return *first;
}

struct ChartPoint {
  std::string label;
  std::string color;
  double x, y;
};

// Points of a metric against effective bits, each labelled, with the Pareto
// frontier (no other point is both cheaper and better) dashed through them.
std::string frontier_chart(const std::string& title, const std::string& y_label, const std::vector<ChartPoint>& points,
                           bool higher_is_better, const Scale& ys, TickText y_tick) {
  const Plot plot{440, 320, 62, 18, 16, 46};
  std::vector<double> bits;
  for (const ChartPoint& p : points) bits.push_back(p.x);
  const auto [lo, hi] = std::minmax_element(bits.begin(), bits.end());
  const Scale xs = bits_scale(*lo, *hi);
  std::string svg = svg_open(plot, title) +
                    plot_frame(plot, xs, ys, "effective bits per element (log scale)", y_label,
                               [](double v) { return compact(v); }, y_tick);

  std::vector<ChartPoint> sorted = points;
  std::sort(sorted.begin(), sorted.end(), [&](const ChartPoint& a, const ChartPoint& b) {
    return a.x != b.x ? a.x < b.x : (higher_is_better ? a.y > b.y : a.y < b.y);
  });
  std::string frontier;
  std::optional<double> best;
  for (const ChartPoint& p : sorted) {
    if (!best || (higher_is_better ? p.y > *best : p.y < *best)) {
      best = p.y;
      frontier += (frontier.empty() ? "" : " ") + coordinate(plot.x(xs, p.x)) + "," + coordinate(plot.y(ys, p.y));
    }
  }
  svg += "<polyline class=\"frontier\" points=\"" + frontier + "\"/>";

  std::vector<Box> taken;
  for (const ChartPoint& p : points) {
    const double px = plot.x(xs, p.x), py = plot.y(ys, p.y);
    taken.push_back({px - 6, py - 6, px + 6, py + 6});
  }
  std::string labels;
  for (const ChartPoint& p : points) {
    const double px = plot.x(xs, p.x), py = plot.y(ys, p.y);
    svg += "<circle class=\"point\" data-config=\"" + html_escaped(p.label) + "\" cx=\"" + coordinate(px) + "\" cy=\"" +
           coordinate(py) + "\" r=\"6\" fill=\"" + p.color + "\"><title>" +
           html_escaped(p.label + ": " + compact(p.x) + " bits, " + y_label + " " + compact(p.y)) + "</title></circle>";
    const double text_width = 6.4 * static_cast<double>(p.label.size());
    const Box box = label_box(px, py, text_width, taken, plot);
    taken.push_back(box);
    // A label pushed away from its point gets a leader line to it.
    const double nearest_x = std::clamp(px, box.x0, box.x1), nearest_y = std::clamp(py, box.y0, box.y1);
    if (std::hypot(nearest_x - px, nearest_y - py) > 14) {
      labels += "<line class=\"leader\" x1=\"" + coordinate(px) + "\" y1=\"" + coordinate(py) + "\" x2=\"" +
                coordinate(nearest_x) + "\" y2=\"" + coordinate(nearest_y) + "\"/>";
    }
    labels += "<text class=\"point-label\" x=\"" + coordinate(box.x0) + "\" y=\"" + coordinate(box.y1 - 2) + "\">" +
              html_escaped(p.label) + "</text>";
  }
  return "<figure><figcaption>" + html_escaped(title) + "</figcaption>" + svg + labels + "</svg></figure>";
}

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;  // (layer, value)
};

// One line per configuration over the layers.
std::string layer_chart(const std::string& title, const std::string& y_label, const std::vector<Series>& series) {
  const Plot plot{440, 300, 62, 18, 14, 46};
  double first = 0, last = 0;
  std::vector<double> values;
  for (const Series& s : series) {
    for (const auto& [layer, value] : s.points) {
      first = values.empty() ? layer : std::min(first, layer);
      last = values.empty() ? layer : std::max(last, layer);
      values.push_back(std::isfinite(value) ? value : 0);
    }
  }
  Scale xs{first - 0.5, last + 0.5, false, {}};
  const double step = std::max(1.0, std::ceil((last - first + 1) / 16));
  for (double layer = first; layer <= last; layer += step) xs.ticks.push_back(layer);
  const Scale ys = linear_scale(0, *std::max_element(values.begin(), values.end()), true);
  std::string svg = svg_open(plot, title) + plot_frame(plot, xs, ys, "layer", y_label,
                                                       [](double v) { return printed("%.0f", v); },
                                                       [](double v) { return compact(v); });
  for (const Series& s : series) {
    std::string line;
    std::string markers;
    for (const auto& [layer, value] : s.points) {
      if (!std::isfinite(value)) continue;
      const std::string x = coordinate(plot.x(xs, layer)), y = coordinate(plot.y(ys, value));
      line += (line.empty() ? "" : " ") + x + "," + y;
      markers += "<circle class=\"marker\" cx=\"" + x + "\" cy=\"" + y + "\" r=\"3\" fill=\"" + s.color + "\"><title>" +
                 html_escaped(s.name + ", layer " + printed("%.0f", layer) + ": " + compact(value)) + "</title></circle>";
    }
    svg += "<g class=\"series\" data-config=\"" + html_escaped(s.name) + "\"><polyline class=\"series-line\" stroke=\"" +
           s.color + "\" points=\"" + line + "\"/>" + markers + "</g>";
  }
  return "<figure><figcaption>" + html_escaped(title) + "</figcaption>" + svg + "</svg></figure>";
}

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
  const std::string html = render_evaluation_report(evaluation);
  // Beside the target, so the rename stays on one file system; the pid keeps
  // two writers of the same report apart.
  const std::filesystem::path temporary = path.string() + ".tmp." + std::to_string(::getpid());
  RemoveOnFailure cleanup(temporary);
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(html.data(), static_cast<std::streamsize>(html.size()));
    out.close();
    if (!out) throw InputError(path.string(), "", "a writable path for the HTML report");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) throw InputError(path.string(), "", "a writable path for the HTML report (" + error.message() + ")");
  cleanup.release();
}

}  // namespace kvforge
