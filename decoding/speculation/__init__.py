"""Speculation's meaning: draft trees, verification (a drafted tree scored in one forward and decided
under an acceptance rule), the sampling rules and their Gumbel noise, sequences and their stop rules,
slots (a live sequence's place in the batch), and the forward cost model the planner prices steps with.

It imports `decoding.base` and `decoding.runtime`; the drafters, trees and schedules sit above it.
"""
