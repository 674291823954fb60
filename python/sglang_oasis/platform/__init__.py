"""Platform support: what SGLang needs from us to run on a given kind of machine."""
