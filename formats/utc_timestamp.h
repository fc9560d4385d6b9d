#pragma once
// The creation times kvforge's files record: "YYYY-MM-DDTHH:MM:SSZ".
#include <string>

namespace kvforge {

std::string current_utc_timestamp();

}  // namespace kvforge
