"""compnode"""
