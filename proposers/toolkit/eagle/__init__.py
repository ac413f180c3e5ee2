"""What the EAGLE-style families share (EAGLE-3, P-EAGLE): the decoder over [embedding ; fc(features)]
(`decoder.py`) and how a speculators config of one becomes the project's (`config.py`); its
speculators fields are proposers/toolkit/speculators_layout.py's `SpeculatorsEagle`."""
