#include "formats/fingerprint_attributes.h"

#include <string>

namespace kvforge {

void write_model_fingerprint(hdf5::Group& group, const ModelFingerprint& model) {
  group.write_string("architecture", model.architecture);
  group.write_scalar<int64_t>("num_layers", model.num_layers);
  group.write_scalar<int64_t>("num_heads", model.num_heads);
  group.write_scalar<int64_t>("num_kv_heads", model.num_kv_heads);
  group.write_scalar<int64_t>("head_dim", model.head_dim);
  group.write_scalar<int64_t>("hidden_size", model.hidden_size);
  group.write_scalar<int64_t>("vocab_size", model.vocab_size);
  group.write_string("rope", model.rope);
  group.write_string("kvo_sha256", model.kvo_sha256);
  group.write_string("tokenizer_sha256", model.tokenizer_sha256);
}

ModelFingerprint read_model_fingerprint(const hdf5::Group& group) {
  ModelFingerprint model;
  model.architecture = group.read_string("architecture");
  model.num_layers = group.read_integer<int64_t>("num_layers");
  model.num_heads = group.read_integer<int64_t>("num_heads");
  model.num_kv_heads = group.read_integer<int64_t>("num_kv_heads");
  model.head_dim = group.read_integer<int64_t>("head_dim");
  model.hidden_size = group.read_integer<int64_t>("hidden_size");
  model.vocab_size = group.read_integer<int64_t>("vocab_size");
  model.rope = group.read_string("rope");
  model.kvo_sha256 = group.read_string("kvo_sha256");
  model.tokenizer_sha256 = group.read_string("tokenizer_sha256");
  return model;
}

void write_capture_provenance(hdf5::Group& group, const CaptureProvenance& provenance) {
  group.write_string("data_file", provenance.data_file);
  group.write_string("data_sha256", provenance.data_sha256);
  group.write_scalar<int64_t>("data_tokens", provenance.data_tokens);
  group.write_scalar<int64_t>("samples", provenance.samples);
  group.write_scalar<int64_t>("seq_len", provenance.seq_len);
  group.write_scalar<uint64_t>("seed", provenance.seed);
  group.write_scalar<uint8_t>("bos", provenance.bos ? 1 : 0);
  group.write_string("compute_dtype", provenance.compute_dtype);
  group.write_string("device", provenance.device);
  group.write_string("tool_version", provenance.tool_version);
  group.write_string("command_line", provenance.command_line);
}

CaptureProvenance read_capture_provenance(const hdf5::Group& group) {
  CaptureProvenance provenance;
  provenance.data_file = group.read_string("data_file");
  provenance.data_sha256 = group.read_string("data_sha256");
  provenance.data_tokens = group.read_integer<int64_t>("data_tokens");
  provenance.samples = group.read_integer<int64_t>("samples");
  provenance.seq_len = group.read_integer<int64_t>("seq_len");
  provenance.seed = group.read_integer<uint64_t>("seed");
  const int64_t bos = group.read_integer<int64_t>("bos");
  if (bos != 0 && bos != 1) {
    hdf5::Location(group.where().file(), group.where().name() + "@bos")
        .fail("expected 0 or 1, got " + std::to_string(bos));
  }
  provenance.bos = bos == 1;
  provenance.compute_dtype = group.read_string("compute_dtype");
  provenance.device = group.read_string("device");
  provenance.tool_version = group.read_string("tool_version");
  provenance.command_line = group.read_string("command_line");
  return provenance;
}

}  // namespace kvforge
