"""hf_specdec `universal` speculative decoding as a transformers `custom_generate` entry point.

Usage and options: README.md in the folder above this one. The decoding loop lives in the installed
`hf_specdec` package (pip install hf_specdec); this file only binds the method name.
"""

from hf_specdec.entry import generate_with_method

METHOD = "universal"
PROVIDER = None  # the module that registers the method (None: built into hf_specdec)


def generate(*args, model, **kwargs):
    # model=: transformers' custom_generate="..." passes it so; a model folder that carries this file makes it the
    # model's own generate (functools.partial(generate, model=model)), called with the call's arguments as given
    if PROVIDER is not None:
        __import__(PROVIDER)
    return generate_with_method(METHOD, model, *args, **kwargs)
