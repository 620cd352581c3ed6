# The progress job of `aalis-proxy annotate --format ndjson`, in jq, for an
# OpenAI-style SSE stream read as raw lines (jq -nRc -f progress_sse.jq):
# strip `data: `, keep per-index name and accumulated argument length (UTF-16
# code units, as JavaScript's String.length), one progress line per
# tool-call delta. A baseline for scripts/bench.sh, not a reference.
def utf16len: length + ([explode[] | select(. > 65535)] | length);
foreach (inputs
         | select(startswith("data: "))
         | .[6:]
         | select(. != "[DONE]")
         | (try fromjson catch null)
         | objects) as $c
  ({n: {}, l: {}, out: []};
   .out = []
   | reduce ($c.choices // [] | .[] | .delta.tool_calls // [] | .[]) as $t (.;
       ($t.index | tostring) as $k
       | (if ($t.function.name // "") != "" then .n[$k] = $t.function.name else . end)
       | .l[$k] = ((.l[$k] // 0) + ($t.function.arguments // "" | utf16len))
       | .out += [{index: $t.index, name: (.n[$k] // ""), charsAccumulated: .l[$k]}]);
   .out[] | {toolCallProgress: .})
