"""What specreplay does with every field of a drafter config.json (docs/config-fields.md), stage 2.

The layouts (proposers/<family>/layout.py, torch-free) declare every key they know; a namespace
specreplay enumerates (`dflash_config`, `eagle_config`, `speculators_config`) refuses any other key
when the file is validated. Here, once transformers is at hand:

- known.py: a key of a namespace that is a transformers config (a decoder's top level,
  `transformer_layer_config`, `text_config`) that neither transformers' config class nor the
  layout declares is refused by name;
- rules.py, decoder_rules.py: a field an engine honours that the replay does not implement is
  refused by name when its value is not the neutral one, naming the value and the engines.
"""
