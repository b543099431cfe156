"""What the worker makes of its model's text before it goes on the bus.

A model writes one stream of text per choice; some of it is meant for the client as content, some is a
function call (and, later, reasoning). Only the worker knows its model, so the split happens here, per
choice, as the text arrives: `output.JobOutput` passes each choice's text through its parsers and rewrites
the `Tokens` events so that `text` holds the content and `tool_calls` the calls' deltas. Each parser's
output depends only on the text it has read, never on how that text was cut into pieces, so a stream, the
whole answer, and a job continued on another worker all see the same calls.

    scan.CallScanner    one JSON object read a character at a time as {"name", "arguments"}
    tools               the tool parsers: <tool_call> tags, plain JSON, a forced function
    formats             the registry of tool-call formats a worker setting names (parser, how to prompt)
    output              a job's parsers, per choice; resuming them after another worker's tokens

A reasoning parser (`<think>...</think>`) belongs beside the tool parser as a stage that runs before it on
the same text: `output.ChoiceOutput` is the place that chains them.
"""
