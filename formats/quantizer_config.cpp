#include "formats/quantizer_config.h"

namespace kvforge {

std::string_view method_name(QuantMethod method) {
  switch (method) {
    case QuantMethod::kKvquant: return "kvquant";
    case QuantMethod::kKivi: return "kivi";
    case QuantMethod::kInt2Rot: return "int2-rot";
    case QuantMethod::kRtn: return "rtn";
  }
  return "?";
}

std::optional<QuantMethod> parse_method(std::string_view name) {
  for (const auto method : {QuantMethod::kKvquant, QuantMethod::kKivi, QuantMethod::kInt2Rot, QuantMethod::kRtn}) {
    if (method_name(method) == name) return method;
  }
  return std::nullopt;
}

std::string_view grouping_name(Grouping grouping) {
  switch (grouping) {
    case Grouping::kPerToken: return "per_token";
    case Grouping::kPerChannelTokens: return "per_channel_tokens";
    case Grouping::kPerChannelOffline: return "per_channel_offline";
  }
  return "?";
}

std::optional<Grouping> parse_grouping(std::string_view name) {
  for (const auto grouping : {Grouping::kPerToken, Grouping::kPerChannelTokens, Grouping::kPerChannelOffline}) {
    if (grouping_name(grouping) == name) return grouping;
  }
  return std::nullopt;
}

}  // namespace kvforge
