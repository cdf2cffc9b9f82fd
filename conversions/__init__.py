"""Readers for published drafter checkpoint layouts (installed as ``hf_specdec.conversions``)."""
