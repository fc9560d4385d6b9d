#include "eval/svg_chart.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "eval/evaluation_report.h"

namespace kvforge::svg {

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


// --- scales ------------------------------------------------------------------


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

}  // namespace kvforge::svg
