"""The voice toy: a persona (personas/*.yaml) on the boardtalk voice loop; ``python -m voice_demo``.

persona.py (YAML, validated), wake.py (wake phrase on the ASR transcript), guard.py (reply word filter),
earcons.py (numpy tones), face.py (terminal face), toy.py (the loop with all of that around it),
run.py (file and live drivers), cli.py (options). See docs/voice_demo.md.
"""
