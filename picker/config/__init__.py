"""Configuration: what the picker is told, read whole and validated before anything starts.

`model.py` owns the model (every setting and its default: one owner per default); `sources.py`
reads it from a file, the environment and the command line; `serve_flags.py` is `picker serve`'s
flags; `reference_flags.py` and `plugins.py` read the reference picker's flags and its
`EndpointPickerConfig` plugin file into the same model. The model imports nothing of the picker;
the readers import the model.
"""
