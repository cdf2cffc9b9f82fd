"""Where a method's proposer is built: its registry record's ``build`` with the options resolved and the drafter
loaded, then wrapped in hybrid drafting unless ``hybrid=`` turns it off (a model drafter's default: suffix decoding
under the adaptive schedule). The registry holds the records only; the entry
points (and ``auto``, which builds the method it chooses) build through here.

Example::

    from hf_specdec import build_proposer

    proposer = build_proposer("eagle3", model, drafter="hf_specdec/drafters/smollm2-135m-eagle3", hybrid="suffix")
"""

from __future__ import annotations

from .. import registry
from .hybrid import source, wrap


def build_proposer(method: str, model, **opts):
    """The proposer of ``method`` for target ``model``; ``opts`` are the method's keyword arguments (``None``: not
    given). A drafter given as a path or Hub id is loaded once per target
    (:func:`~hf_specdec.registry.load_drafter`); a method with the ``hybrid`` option is wrapped in hybrid drafting
    unless it is off (:func:`.hybrid.source`: by default suffix decoding under the adaptive schedule)."""
    record = registry.get(method)
    resolved = record.resolve(opts)
    if record.drafter is not None:
        resolved["drafter"] = registry.load_drafter(record, resolved["drafter"], model, resolved)
    proposer = record.build(model, resolved)
    if "hybrid" in resolved:  # a model drafter: with a drafter-free source unless that is off
        proposer = wrap(proposer, source(resolved))
    return proposer
