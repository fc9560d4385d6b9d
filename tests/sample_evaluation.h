#pragma once
// A hand-made Evaluation with every measurement filled in, for the tests of
// what reads evaluations (JSON, table, gate, HTML report): pyllama-16m's
// shapes (5 layers), the 16-bit cache and three 2-bit configurations, a
// needle grid of 3 contexts x 5 depths, and 3 tasks, one of which flips.
#include "eval/evaluation.h"

namespace kvforge::testing {

Evaluation sample_evaluation();

}  // namespace kvforge::testing
