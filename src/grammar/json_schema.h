// JSON Schema -> grammar over the bytes of the compact JSON text of its instances, and the
// Qwen3.6 XML tool-call format with schema-typed parameters. The supported subset (docs/API.md,
// "Structured output"): type (and unions), properties, required, additionalProperties, enum,
// const, anyOf, oneOf (generated as anyOf), allOf of one schema, items, prefixItems, minItems,
// maxItems, minLength, maxLength, pattern, format (date, time, date-time, uuid, email), minimum,
// maximum, exclusiveMinimum, exclusiveMaximum, $ref / $defs / definitions (recursion included),
// nullable. Annotations (title, description, default, examples, ...) are ignored. Any other
// keyword is refused with SchemaError naming it and where it is.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "grammar/grammar.h"

namespace tansy::grammar {

using Json = nlohmann::ordered_json;

struct SchemaError : Error {
  using Error::Error;
};

// What a grammar's text may be preceded by: after a reasoning block the model writes "\n\n"
// before its answer; up to two newlines are allowed there.
struct Framing {
  bool leading_newlines = false;
};

// The compact JSON text of an instance of `schema` (an object or a boolean).
std::shared_ptr<Grammar> json_schema_grammar(const Json& schema, const Framing& f = {});
// Any JSON object (response_format json_object).
std::shared_ptr<Grammar> json_object_grammar(const Framing& f = {});
// A regular expression (the subset of docs/API.md), matched in full, as raw UTF-8 text.
std::shared_ptr<Grammar> regex_grammar(const std::string& pattern);

struct ToolSpec {
  std::string name;
  Json parameters;          // null: no schema (no parameters are generated)
  bool constrained = true;  // false: any parameters with any values
};
enum class ToolMode {
  kRequired,  // one or more calls, nothing else
  kAuto,      // free text, then optionally calls
};
// What kAuto allows instead of calls: free text, or a JSON document (response_format).
struct ToolContent {
  enum class Kind { kFree, kJsonObject, kJsonSchema } kind = Kind::kFree;
  Json schema;
};
// Qwen3.6's tool-call text: <tool_call>\n<function=NAME>\n(<parameter=P>\nVALUE\n</parameter>\n)*
// </function>\n</tool_call>, calls separated by "\n". A parameter whose schema type is "string"
// (or string and null) is raw text, as the output parser reads it; others are compact JSON.
// single_call: one call at most (parallel_tool_calls false).
std::shared_ptr<Grammar> tool_call_grammar(const std::vector<ToolSpec>& tools, ToolMode mode,
                                           const Framing& f = {}, const ToolContent& content = {},
                                           bool single_call = false);

}  // namespace tansy::grammar
