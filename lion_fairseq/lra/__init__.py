"""Long Range Arena helpers that need no fairseq: pixel orderings (``ordering``), the ListOps generator
(``listops``) and a small synthetic Pathfinder-like generator (``pathfinder``)."""
