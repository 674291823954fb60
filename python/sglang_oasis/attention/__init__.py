"""The ``oasis`` attention backend registered with SGLang."""
