"""`mmspec demo`: a Gradio app that shows speculative decoding at work, plain and speculative side by side, on
every pipeline (discrete c2i / t2i images, continuous MAR + CSpD, the VLM).

One concept per file: `models.py` (lazy, cached pipelines), `inputs.py` (parsing and checking what a user typed),
`acceptance_map.py` (the token-grid maps), `canvas.py` (is an upload like the zoo VLM's canvases?), `plots.py` (the
acceptance histogram), `answer.py` (the VLM answer with its drafted tokens highlighted), `handlers.py` (plain
functions: values in, images / dicts / HTML out), `app.py` (the Gradio layout over the handlers) and `__main__.py`
(the command line). Only `app.py` and `__main__.py` import Gradio.
"""
