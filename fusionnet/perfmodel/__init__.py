"""perfmodel"""
