#!/bin/bash
cd /app/repo
git checkout -- config.ini
git branch release
