#pragma once
// The model fingerprint and the capture provenance as HDF5 attributes: the
// same names and types in the activation store (/model, /provenance) and the
// artifact (/model, /calibration/sources/<k>).
#include "formats/activation_store.h"
#include "formats/hdf5_file.h"

namespace kvforge {

void write_model_fingerprint(hdf5::Group& group, const ModelFingerprint& model);
ModelFingerprint read_model_fingerprint(const hdf5::Group& group);
void write_capture_provenance(hdf5::Group& group, const CaptureProvenance& provenance);
CaptureProvenance read_capture_provenance(const hdf5::Group& group);  // bos must be 0 or 1

}  // namespace kvforge
