#pragma once
// Flags shared by the commands that run a model: --model, --device, --dtype.
#include <CLI/CLI.hpp>

#include <string>

#include "model/device.h"

namespace kvforge::cli {

struct ModelFlags {
  std::string model_dir;
  std::string device = "cpu";
  std::string dtype;  // empty: fp32 on CPU, bf16 on CUDA
  std::string attention = "auto";

  void add_to(CLI::App& command);
  ComputeTarget target() const;  // validates --device and --dtype
};

}  // namespace kvforge::cli
