#pragma once
// The calibration artifact: one HDF5 file per model holding the named
// quantizer configurations `kvforge calibrate` fitted (settings, every
// layer's fitted parameters and calibration statistics, effective bits, and
// the rotations `kvforge rotate` learned), the model they were fitted for and
// what they were fitted on. Serving loads it (the CUDA kernels), `kvforge
// eval` compares its configurations. The layout
// on disk, the arithmetic each field takes part in, the version and the
// compatibility rules are specified in docs/artifact.md.
//
// Nothing degenerate is written or read: the same rules (finite values,
// fitted scales, sorted grids of 2^bits levels, consistent thresholds,
// orthogonal rotations of forms the key domain allows, shapes of the model)
// are checked before writing and after reading, and a broken
// rule is an InputError naming the file and the object of the file the value
// is (or would be) stored in, e.g.
// "a.h5: /configs/kvquant/layers/3/keys/channel_scale: expected values > 0, element [1, 5] is 0".
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "formats/activation_store.h"
#include "formats/quantizer_config.h"
#include "formats/utc_timestamp.h"

namespace kvforge {

// Of schema "kvforge.artifact": the version write_artifact writes (3: with
// rotations). read_artifact also reads version 2 files (no rotations) and
// version 1 files (no rotations, no per-tensor outlier, residual or Q-Norm
// rules; docs/artifact.md says how they map onto version 2 values) and
// refuses any other version.
inline constexpr int kArtifactVersion = 3;
inline constexpr int kOldestReadableArtifactVersion = 1;

struct CalibrationProvenance {             // what the quantizers were fitted on
  std::vector<CaptureProvenance> sources;  // from the activation store (ActivationStoreReader::sources())
  int64_t calibration_tokens = 0;          // tokens the fit used
  std::string store_file;                  // file name of the activation store
  bool operator==(const CalibrationProvenance&) const = default;
};

struct Artifact {
  ModelFingerprint model;
  CalibrationProvenance calibration;
  std::string tool_version, command_line;
  std::string created_utc;               // "YYYY-MM-DDTHH:MM:SSZ", e.g. current_utc_timestamp()
  std::vector<QuantizerConfig> configs;  // named configurations, names unique, kept in this order
  bool operator==(const Artifact&) const = default;
};

// Validates (InputError(path, object, expectation) naming the first broken
// rule, see docs/artifact.md), then writes path + ".tmp", reads it back,
// and renames it to path: a refused or failed write leaves no file behind and
// an existing file at path untouched.
void write_artifact(const std::filesystem::path& path, const Artifact& artifact);

// Reads and validates everything before returning: schema, version, every
// required group, attribute and dataset (types, shapes against /model),
// values (finite, fitted, sorted, consistent). InputError(path, object,
// expectation) otherwise, e.g. object "/configs/kivi/layers/0/keys/grid".
// A version 1 or 2 file comes back in version 3 terms, without rotations
// (writing it again writes version 3).
Artifact read_artifact(const std::filesystem::path& path);

// InputError(artifact_file, "model.<field>", ...) naming the first
// fingerprint field in which `model` differs from the artifact's.
void check_artifact_matches(const Artifact& artifact, const ModelFingerprint& model, const std::string& artifact_file);

}  // namespace kvforge
