"""capturing"""
