#!/bin/bash
echo "hello, terminal" > /app/greeting.txt
