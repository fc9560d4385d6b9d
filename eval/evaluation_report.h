#pragma once
// The HTML report of an Evaluation (`kvforge eval --report report.html`):
// one self-contained page (inline CSS, inline SVG charts, no script, nothing
// fetched) with
//   - a header: model, artifact, data, command line, device, date, windows;
//   - the comparison table (eval/evaluation_table.h's cells);
//   - the frontier charts: perplexity, KL and needle accuracy against
//     effective bits, every configuration a labelled point;
//   - per-layer attention-output error charts, one line per configuration;
//   - one needle accuracy heatmap per configuration (depth x context, the
//     accuracy written in each cell);
//   - the tasks that flipped against the 16-bit cache.
// A section whose measurement was not run says so instead of a chart.
// Elements tests and tools can find: <header id="header">, <section
// id="comparison|frontier|attention|needles|tasks">, one <circle
// class="point" data-config="NAME"> per configuration in each frontier chart,
// one <g class="heatmap" data-config="NAME"> per configuration with needles.
// The page is a pure function of the Evaluation (no clock read).
#include <filesystem>
#include <string>
#include <string_view>

#include "eval/evaluation.h"

namespace kvforge {

std::string render_evaluation_report(const Evaluation& evaluation);

// Writes the page to `path` through a temporary file in the same directory
// and a rename, so that a failed write leaves no partial report. Throws
// InputError naming the path when it cannot be written.
void write_evaluation_report(const Evaluation& evaluation, const std::filesystem::path& path);

// Text as HTML character data or attribute value: & < > " ' escaped, and
// control characters other than tab and newline replaced by U+FFFD.
std::string html_escaped(std::string_view text);

}  // namespace kvforge
