#pragma once
// The SVG charts of `kvforge eval`'s HTML report, drawn in C++ (no
// JavaScript, no network): colours for configurations and accuracies, linear,
// log and effective-bits scales with "nice" ticks, a labelled scatter with its
// Pareto frontier, and a line chart per layer. Every text is escaped.
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace kvforge::svg {

std::string printed(const char* format, double value);  // snprintf of one number
std::string compact(double value);                      // 4 significant digits
std::string percent_text(double share);                 // 0.25 -> "25%"
std::string coordinate(double value);                   // an SVG coordinate, 0.1 px

// The 16-bit reference (index 0) in near-black, the others in Tableau's
// twenty categorical colours, in the evaluation's order.
std::string configuration_color(std::size_t index);

struct Rgb {
  double r, g, b;  // 0..255
};
std::string hex(const Rgb& c);
Rgb accuracy_rgb(double accuracy);        // 0 red, 0.5 yellow, 1 green (ColorBrewer RdYlGn ends)
std::string text_color_on(const Rgb& c);  // dark on light, white on dark

// A value range mapped onto a pixel range, linear or logarithmic, with the
// values that get a tick and a grid line.
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
Scale linear_scale(double lo, double hi, bool from_zero);
Scale log_scale(double lo, double hi);       // 1-2-5 ticks per decade
Scale bits_scale(double lo, double hi);      // log2 effective bits
Scale value_scale(const std::vector<double>& values, bool from_zero);

using TickText = std::string (*)(double);

struct ChartPoint {
  std::string label;
  std::string color;
  double x, y;
};
// Points of a metric against effective bits, each labelled, with the Pareto
// frontier dashed through them.
std::string frontier_chart(const std::string& title, const std::string& y_label, const std::vector<ChartPoint>& points,
                           bool higher_is_better, const Scale& ys, TickText y_tick);

struct Series {
  std::string name;
  std::string color;
  std::vector<std::pair<double, double>> points;  // (layer, value)
};
// One line per series over the layers.
std::string layer_chart(const std::string& title, const std::string& y_label, const std::vector<Series>& series);

}  // namespace kvforge::svg
