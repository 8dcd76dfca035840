#!/bin/bash
cd /app/repo
git add notes.txt
git commit -q -m "Add notes"
