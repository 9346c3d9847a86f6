"""``python -m preprocess``: point to the three commands."""
import sys

USAGE = """usage:
  python -m preprocess.text --input FILE [FILE ...] --destdir DIR [--vocab-size N] ...
      raw text -> sentencepiece -> fairseq train/valid/test binaries (masked_lm, language_modeling)
  python -m preprocess.glue --train TSV --dev TSV [--test TSV] --spm MODEL --dict DICT --destdir DIR
                            --columns S1[,S2],LABEL ...
      GLUE-style TSV -> input0/ input1/ label/ for sentence_prediction
  python -m preprocess.lra {listops,text,retrieval,image,pathfinder} --input-dir DIR --destdir DIR ...
      Long Range Arena releases -> input0/ (input1/) label/ and lra.json for the lra_* tasks
Each takes --help; see preprocess/README.md."""

if __name__ == "__main__":
    print(USAGE)
    sys.exit(0 if len(sys.argv) == 1 or sys.argv[1] in ("-h", "--help") else 2)
