#!/bin/bash
# run-tests.sh (terminal-bench's) decides: its exit status is pytest's, and all tests passing is reward 1.
mkdir -p /logs/verifier
TEST_DIR=/tests bash /tests/run-tests.sh
if [ $? -eq 0 ]; then reward=1; else reward=0; fi
echo $reward > /logs/verifier/reward.txt
