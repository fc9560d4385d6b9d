#include "formats/quantizer_config.h"

#include "formats/name_table.h"

namespace kvforge {
namespace {

// One table of names per enum: the name functions and the parsers read the
// same rows, so the artifact's writer, reader and printer cannot disagree.
constexpr NameTable<QuantMethod, 4> kMethodNames{{{QuantMethod::kKvquant, "kvquant"},
                                                  {QuantMethod::kKivi, "kivi"},
                                                  {QuantMethod::kInt2Rot, "int2-rot"},
                                                  {QuantMethod::kRtn, "rtn"}}};
constexpr NameTable<Grouping, 4> kGroupingNames{{{Grouping::kPerToken, "per_token"},
                                                 {Grouping::kPerChannelTokens, "per_channel_tokens"},
                                                 {Grouping::kPerChannelOffline, "per_channel_offline"},
                                                 {Grouping::kPerTokenAllHeads, "per_token_all_heads"}}};
constexpr NameTable<ResidualRule, 2> kResidualRuleNames{{{ResidualRule::kSliding, "sliding"},
                                                         {ResidualRule::kBlockFlush, "block_flush"}}};
constexpr NameTable<OutlierRule, 4> kOutlierRuleNames{{{OutlierRule::kNone, "none"},
                                                       {OutlierRule::kChannelThresholds, "channel_thresholds"},
                                                       {OutlierRule::kTokenTopBottom, "token_top_bottom"},
                                                       {OutlierRule::kTokenTau, "token_tau"}}};
constexpr NameTable<QNorm, 3> kQNormNames{{{QNorm::kNone, "none"}, {QNorm::kAffine, "affine"},
                                           {QNorm::kIterated, "iterated"}}};
constexpr NameTable<RotationBasis, 4> kBasisNames{{{RotationBasis::kIdentity, "identity"},
                                                  {RotationBasis::kHadamard, "hadamard"},
                                                  {RotationBasis::kEigen, "eigen"},
                                                  {RotationBasis::kRandom, "random"}}};
constexpr NameTable<RotationForm, 3> kRotationFormNames{{{RotationForm::kNone, "none"},
                                                         {RotationForm::kMatrix, "matrix"},
                                                         {RotationForm::kPairAngles, "pair_angles"}}};

}  // namespace

std::string_view method_name(QuantMethod method) { return name_in(kMethodNames, method); }
std::optional<QuantMethod> parse_method(std::string_view name) { return parse_in(kMethodNames, name); }
std::string_view grouping_name(Grouping grouping) { return name_in(kGroupingNames, grouping); }
std::optional<Grouping> parse_grouping(std::string_view name) { return parse_in(kGroupingNames, name); }
bool is_runtime_grouping(Grouping grouping) { return grouping != Grouping::kPerChannelOffline; }
std::string_view residual_rule_name(ResidualRule rule) { return name_in(kResidualRuleNames, rule); }
std::optional<ResidualRule> parse_residual_rule(std::string_view name) { return parse_in(kResidualRuleNames, name); }
std::string_view outlier_rule_name(OutlierRule rule) { return name_in(kOutlierRuleNames, rule); }
std::optional<OutlierRule> parse_outlier_rule(std::string_view name) { return parse_in(kOutlierRuleNames, name); }
std::string_view q_norm_name(QNorm q_norm) { return name_in(kQNormNames, q_norm); }
std::optional<QNorm> parse_q_norm(std::string_view name) { return parse_in(kQNormNames, name); }
std::string_view basis_name(RotationBasis basis) { return name_in(kBasisNames, basis); }
std::optional<RotationBasis> parse_basis(std::string_view name) { return parse_in(kBasisNames, name); }
std::string_view rotation_form_name(RotationForm form) { return name_in(kRotationFormNames, form); }
std::optional<RotationForm> parse_rotation_form(std::string_view name) { return parse_in(kRotationFormNames, name); }

}  // namespace kvforge
