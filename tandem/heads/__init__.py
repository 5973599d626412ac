"""EAGLE heads shipped with tandem, one directory per alias (see ``tandem/loader/heads.py``)."""
