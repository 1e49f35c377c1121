"""The notebook face: magics, prompt building, streaming into cells, rendering, chats, widgets.

`magics` declares the magics (argument tables and one-line calls); `session` holds the
session's state and operations without IPython, and `cellview` what a cell shows around its
answer; `prompting` reads options and builds prompts;
`streaming` follows a request and feeds its events to a view; the displays turn a request's
state into display bundles, one module per thing drawn (`answerview`, `summary`,
`imagesview`, `stripfeed`, `tables`, on `render`'s bundles and escaping); `chat` keeps
named conversations; `widgets` holds the anywidget classes (their ES modules and CSS ship
in `mlx_nbengine/notebook/static`, built from the repository's top-level `widgets/`
folder). Imports point down only: this layer uses the engine, never the other way round.
"""
