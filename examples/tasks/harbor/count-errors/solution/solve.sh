#!/bin/bash
grep -c 'ERROR' /app/data/log.txt > /app/error_count.txt
grep 'ERROR' /app/data/log.txt | sed 's/.*ERROR //' | sort -u > /app/error_messages.txt
