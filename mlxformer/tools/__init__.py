"""Tools over a model: conversion, perplexity, benchmarking, memory planning (``info``)."""
