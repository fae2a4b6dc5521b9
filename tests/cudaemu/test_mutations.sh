#!/bin/sh
# The mutation check (mutations.py): defects planted one at a time in copies of gpu/*.cu must each
# make test_gpu fail under the emulation; a mutation that no longer applies fails too.
exec "${PYTHON3:-python3}" "$EMU_SRC/mutations.py"
