#pragma once
// `kvforge inspect ARTIFACT.h5 [--acts STORE.h5]`: the artifact's
// configurations layer by layer, optionally measured on another store.
#include <cstdint>
#include <string>

namespace kvforge::cli {

int inspect_artifact(const std::string& artifact_file, const std::string& acts_file, int64_t samples, bool json);

}  // namespace kvforge::cli
