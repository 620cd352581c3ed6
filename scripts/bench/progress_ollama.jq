# The progress job of `aalis-proxy annotate --format ndjson`, in jq, for an
# Ollama /api/chat NDJSON stream read as raw lines (jq -nRc -f
# progress_ollama.jq): tool calls come whole, so each one's progress counts
# its arguments' compact JSON (UTF-16 code units); every call is distinct,
# numbered by its wire index when still free, else the next number. A
# baseline for scripts/bench.sh, not a reference.
def utf16len: length + ([explode[] | select(. > 65535)] | length);
foreach (inputs | (try fromjson catch null) | objects) as $c
  ({next: 0, out: []};
   .out = []
   | reduce ($c.message.tool_calls // [] | .[]) as $t (.;
       ($t.function.index) as $w
       | (if ($w | type) == "number" and $w >= .next then $w else .next end) as $i
       | .next = $i + 1
       | .out += [{index: $i, name: ($t.function.name // ""),
                   charsAccumulated: ($t.function.arguments | tojson | utf16len)}]);
   .out[] | {toolCallProgress: .})
