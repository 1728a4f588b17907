/* keeps the support library non-empty */
typedef int kvb_test_support_empty_;
